"""Host memory for weights being staged (read, converted, laid out in numpy, then copied
into device buffers).

numpy asks the kernel for transparent huge pages (``madvise(MADV_HUGEPAGE)``) on every
array of 4 MiB or more. On some virtual machines a huge-page fault costs ~30x what the
same memory costs in 4 KiB pages: on the 2-core VM this project is developed and tested
on, filling a fresh 400 MB array takes 4.9 s with the advice and 0.17 s without, and
loading SmolLM2-135M from its GGUF took 20.7 s instead of 5.4 s. Staged weights are
temporaries that are copied to device buffers once, so huge pages buy them nothing:
:func:`staging` turns the advice off while they are built and restores numpy's setting
after (numpy's own switch, the one ``NUMPY_MADVISE_HUGEPAGE=0`` sets at import).
"""
from __future__ import annotations

import contextlib


def _switch():
    """numpy's ``_set_madvise_hugepage`` (numpy >= 1.20, in ``numpy._core`` from 2.0), or
    None on a numpy without it."""
    try:
        from numpy._core import multiarray
    except ImportError:  # numpy 1.x
        from numpy.core import multiarray
    return getattr(multiarray, "_set_madvise_hugepage", None)


@contextlib.contextmanager
def staging():
    """Within: numpy allocates without the huge-page advice; on exit the setting is what it
    was (nesting is fine). numpy's switch is process-wide: two threads loading at once
    may leave it off (a speed effect only; results never depend on it)."""
    switch = _switch()
    if switch is None:
        yield
        return
    before = switch(False)
    try:
        yield
    finally:
        switch(before)
