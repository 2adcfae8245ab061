"""`kvshuttle bench`: the multi-turn benchmark (pull vs recompute vs ideal), control-plane overhead, service microbenchmarks."""
