"""Which code path a layer takes: the one written for a torch.compile graph, or the eager one.

torch.compiler.is_compiling() alone cannot tell: torch holds it True for the whole process while any thread
compiles, so the engine thread's eager steps would take the graph-only paths while the decode step compiles in the
background. A layer asks `traced()` instead: True only in a thread that declared it compiles (`compiling_here`),
and there only under torch.compile, which evaluates the thread check once, at trace time, as a constant."""

import contextlib
import threading
from collections.abc import Iterator

import torch

_compiling_threads: set[int] = set()


def _in_compiling_thread() -> bool:  # marked a constant for dynamo by the first `compiling_here`
    return threading.get_ident() in _compiling_threads


def traced() -> bool:
    return torch.compiler.is_compiling() and _in_compiling_thread()


@contextlib.contextmanager
def compiling_here() -> Iterator[None]:
    """Within: graphs traced by this thread take the layers' compiled paths."""
    # marked here, not at import: importing torch._dynamo takes a second of a start that answers before compiling
    import torch._dynamo

    torch._dynamo.assume_constant_result(_in_compiling_thread)
    ident = threading.get_ident()
    _compiling_threads.add(ident)
    try:
        yield
    finally:
        _compiling_threads.discard(ident)
