"""The intervention study: one pre-registered plan, fixed conversations, arms labelled blind.

:mod:`.plan` (the committed plan file and its hash) · :mod:`.ledger` (steps done, their cost and output hashes)
· :mod:`.items` (drawing fresh items) · :mod:`.generate` (user turns per arm, stimuli, reading states) ·
:mod:`.sheets` (blind sheets) · :mod:`mechprobe.audit.arms` (reading the labels, the table) · :mod:`.runner` (the steps, ``status``,
``run``). The command is ``mechprobe interventions`` (= ``experiments/interventions.py``).
"""

from mechprobe.audit.arms import paired_difference, study_table, table_markdown
from mechprobe.study.interventions.items import draw_items, used_item_ids
from mechprobe.study.interventions.plan import Arm, Plan, load_plan
from mechprobe.study.interventions.runner import StepStatus, Study

__all__ = ["Arm", "Plan", "load_plan", "Study", "StepStatus", "draw_items", "used_item_ids", "study_table",
           "paired_difference", "table_markdown"]
