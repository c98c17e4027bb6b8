"""A checkpoint directory's two files, checked without torch: a command refuses a wrong path
at once instead of after the seconds its imports of torch and transformers take."""

import os

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def check_checkpoint_dir(path: str | None) -> None:
    """Checks that path is a directory holding `config.json` and `model.safetensors`.

    Args:
        path: the checkpoint directory; None (a command's built-in model) passes.

    Raises:
        NotADirectoryError: path is a file.
        FileNotFoundError: no such directory, or one without either file.
    """
    if path is None:
        return
    if os.path.exists(path) and not os.path.isdir(path):
        raise NotADirectoryError(f"{path!r} is a file; give the checkpoint directory that holds "
                                 f"{CONFIG_FILE} and {WEIGHTS_FILE}")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory {path!r} does not exist")
    for f in (CONFIG_FILE, WEIGHTS_FILE):
        if not os.path.isfile(os.path.join(path, f)):
            raise FileNotFoundError(f"checkpoint directory {path!r} has no {f}")
