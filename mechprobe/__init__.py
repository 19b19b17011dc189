"""mechprobe: mechanistic analysis of interaction awareness in chat language models.

Stages (each reads and writes files in a run directory, so any entry point can resume):
probe (generate assistant + user turns) -> judge (label user turns) -> cache (boundary activations)
-> probes (linear probes per layer) -> steering (vectors that raise genuine follow-ups).
"""

__version__ = "0.1.0"
