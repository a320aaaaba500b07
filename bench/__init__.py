"""``kvlayout bench``: throughput against the machine's copy limits and the pure-torch baseline."""
