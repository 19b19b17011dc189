"""Post-training toward follow-up: does training on real next user turns change what the model expects?

:mod:`.train` (LoRA SFT on real human next turns: :mod:`.conversations` the data, :mod:`.examples` the
loss mask, :mod:`.checkpoints` resumable checkpoints) · :mod:`.pairs` and :mod:`.dpo` (a DPO preference step on the
model's own judged turns) · :mod:`.config` (``PostTrainConfig``) · :mod:`.evaluate` (driver: base vs post-trained
vs baked steering on the same items) · :mod:`.outcomes` (rates and paired tests) · :mod:`.boundary` (the shift
inside the model) · :mod:`.report` (markdown).
"""
