"""swarm-peer --check: whether this machine can join a swarm and serve a stage, checked without joining it.

checks.py holds the result type, the exit code and the verdicts on the machine, swarm_checks.py those on the
swarm, data_checks.py those on the training data (all pure functions of measured figures); probes.py the
measurements (the device, the disks, the network), data_probes.py the data's (its index, a chunk, the cache's
disk); run.py the order of work and its deadlines. The program that prints the
result is peers/swarm_peer.py.
"""
