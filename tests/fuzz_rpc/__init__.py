"""Fuzz tests of the RPC entry points: hostile input at every handler of real peer processes.

They start one peer per stage of a 2-stage tiny swarm (stage 0 takes int64 tokens, stage 1, the last, takes
[hidden states, targets]) and send every handler garbage bytes, truncated and corrupted protobufs, bad metadata,
bad tensors, broken and endless streams, and floods, from client identities in the test process (each a hivemind
P2P daemon of its own). For every case: a well-formed reply comes back (an error reply carries a message and a
known code, never 'internal'), or hivemind refuses bytes it cannot parse, or the stream is closed; never a hang.
The peers stay up; afterwards a valid request from a fresh identity is served, their parameters are exactly as
before (no case may train: none is a valid training request) and their memory stayed bounded.

The peers ban a sender after BAD_REQUESTS_BEFORE_BAN bad requests, so the cases rotate identities before that;
test_abuse.py::test_a_client_that_keeps_sending_bad_requests_is_banned checks the ban itself.

messages.py builds requests and stream frames, hostile.py the hostile inputs, clients.py sends them and checks
the replies, fuzzed_swarm.py starts the peers. The tests of every file here share one swarm (conftest.py) and run
in one process, in the order conftest.RUN_ORDER gives. `pytest -n 0 -s tests/fuzz_rpc` prints the cases tried.
"""
