"""Where a peer sits in the internet: Vivaldi latency coordinates, the cache of start-up network checks that a
restart reuses, and emulated internet links for tests and benchmarks on one machine."""
