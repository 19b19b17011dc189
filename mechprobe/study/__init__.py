"""mechprobe.study.run."""
