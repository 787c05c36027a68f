from .env import VerifiableQAConfig, VerifiableQAEnv
from .tasks import Task, generate_task, is_correct, load_tasks_jsonl

__all__ = ["VerifiableQAConfig", "VerifiableQAEnv", "Task", "generate_task", "is_correct", "load_tasks_jsonl"]
