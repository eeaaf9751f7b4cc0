"""Sharpness in training: geodesic SAM (:mod:`.optim`), a monitor for custom loops
(:mod:`.monitor`) and Hugging Face ``Trainer`` integrations (:mod:`.callbacks`)."""
