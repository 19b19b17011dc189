"""mechprobe.post_train.train."""
