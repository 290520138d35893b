"""Tools beside the library: the float64 reference oracle, the 32-bit index audit, the self-check
and the benchmark. The library never imports them."""
