"""lm-evaluation-harness integration (extra `eval`): the model `contbatch`, registered with lm-eval on import.

`import contbatch.integrations.lm_eval` registers `ContbatchLM` as lm-eval's model `contbatch`, so that
`lm_eval.simple_evaluate(model="contbatch", ...)` runs on contbatch; `contbatch eval` is lm-eval's command line
with it. `TASKS_DIR` holds the shipped offline tasks (`contbatch_gsm8k_mc`, `contbatch_gsm8k_gen`).
"""

from contbatch.data.lm_eval_tasks import TASKS_DIR
from contbatch.integrations.lm_eval.model import ContbatchLM

__all__ = ["TASKS_DIR", "ContbatchLM"]
