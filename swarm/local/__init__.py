"""A whole swarm on one machine: what swarm-demo, the tests and the benchmarks start peers with. A peer never
imports it (tests/test_layout.py checks that only the programs that start peers do).

- processes.py: peer processes on loopback (started in sessions of their own, stopped cleanly or killed with
  their DHT process and p2pd daemon), their logs read as they are written, the processes of a peer found in /proc.
- forkserver.py: peers forked from a process that has imported them once (swarm-demo and the tests start their
  peers so; the tests unless SWARM_TEST_FORK_PEERS=0): a start without the 5 s of CPU that importing torch and
  hivemind costs.
- fast_swarm.py: the small, fast swarm (a manifest dictionary) that the tests and the benchmarks start.
- emulated_links.py: emulated internet links (bandwidth, delay, jitter) between peers on one machine.
"""
