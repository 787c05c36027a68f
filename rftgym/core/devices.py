"""Whether a torch device named by a user (``--device``, ``TrainConfig.device``) can run rftgym here."""

from __future__ import annotations


def checked_device(device) -> str:
    """``device`` (a name, a torch.device, or None: cuda if available, else cpu) as a name torch
    can run here, or a ConfigError saying what is wrong with it: checked before a model loads."""
    import torch

    from .errors import ConfigError

    if isinstance(device, torch.device):
        device = str(device)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    problem = device_problem(device) if isinstance(device, str) else "not a device name (a string such as cpu)"
    if problem is not None:
        raise ConfigError(f"device={device!r}: {problem}")
    return device


def device_problem(device: str) -> str | None:
    """What is wrong with running on ``device`` on this machine, said to follow the setting's name
    ("--device X: ..."), or None when it can run there."""
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        return "not a torch device; use cpu, cuda or cuda:N"
    if parsed.type not in ("cpu", "cuda", "mps", "xpu"):
        return f"rftgym runs on cpu or cuda (got the {parsed.type} device type)"
    available = {"cuda": torch.cuda.is_available,
                 "mps": lambda: torch.backends.mps.is_available(),  # torch.mps has it only from 2.5
                 "xpu": lambda: hasattr(torch, "xpu") and torch.xpu.is_available()}.get(parsed.type)
    if available is not None and not available():
        what = "CUDA" if parsed.type == "cuda" else f"{parsed.type.upper()} device"
        return f"this torch build or machine has no {what}; use cpu"
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        return f"this machine has {count} CUDA device{'s' if count != 1 else ''} (cuda:0 to cuda:{count - 1})"
    return None
