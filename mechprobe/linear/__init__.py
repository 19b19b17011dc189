"""mechprobe.linear."""
