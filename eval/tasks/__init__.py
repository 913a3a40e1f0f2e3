"""The evaluation tasks, by the name ``--tasks`` uses (see each module's docstring for its definition)."""
from .common import EvalContext, TaskOutput, TaskResult, TaskSkipped, run_task
from .decode_cost import DecodeCostTask
from .mqar import MQARLengthTask
from .passkey import PasskeyTask
from .perplexity import PerplexityTask
from .samples import SamplesTask
from .sessions import SessionsTask

TASKS = {task.name: task for task in (PerplexityTask, MQARLengthTask, PasskeyTask, DecodeCostTask, SamplesTask,
                                          SessionsTask)}

__all__ = ["TASKS", "EvalContext", "TaskOutput", "TaskResult", "TaskSkipped", "run_task", "DecodeCostTask",
           "MQARLengthTask", "PasskeyTask", "PerplexityTask", "SamplesTask", "SessionsTask"]
