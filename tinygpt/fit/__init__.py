"""What fits this machine and these hours: memory estimates, the GPU probe and its cache, the
size planner and its report."""
