"""The evaluation tasks, by the name ``--tasks`` uses (see each module's docstring for its definition)."""
from eval.tasks.common import EvalContext, TaskOutput, TaskResult, TaskSkipped, run_task
from eval.tasks.decode_cost import DecodeCostTask
from eval.tasks.mqar import MQARLengthTask
from eval.tasks.passkey import PasskeyTask
from eval.tasks.perplexity import PerplexityTask
from eval.tasks.samples import SamplesTask
from eval.tasks.sessions import SessionsTask

TASKS = {task.name: task for task in (PerplexityTask, MQARLengthTask, PasskeyTask, DecodeCostTask, SamplesTask,
                                          SessionsTask)}

__all__ = ["TASKS", "EvalContext", "TaskOutput", "TaskResult", "TaskSkipped", "run_task", "DecodeCostTask",
           "MQARLengthTask", "PasskeyTask", "PerplexityTask", "SamplesTask", "SessionsTask"]
