"""Checkpoints and data as their owners made them, for the command line and the studies:
Hugging Face checkpoints (:mod:`.hf`), their tasks and batches (:mod:`.hfdata`), local
files and built-in datasets (:mod:`.data`), one job's model and batches from the
command line's arguments (:mod:`.job`), and compact vocabularies (:mod:`.vocabulary`).
"""
