from .env import VerifiableQAConfig, VerifiableQAEnv
from .grading import is_correct
from .tasks import Task, generate_task, load_tasks_jsonl

__all__ = ["VerifiableQAConfig", "VerifiableQAEnv", "Task", "generate_task", "is_correct", "load_tasks_jsonl"]
