"""The notebook kernel: whether code runs inside one,
showing an object there, and ipywidgets on demand.

ipywidgets and matplotlib are imported only where they are used (``pip install
"tinygpt[notebooks]"``); outside a notebook every piece still works without them (tables print as
text, a picker's `value` is its default).
"""

from __future__ import annotations

from typing import Any

INSTALL_HINT = 'pip install "tinygpt[notebooks]"  (or: pip install ipywidgets matplotlib)'


def in_notebook() -> bool:
    """True inside a Jupyter / Colab kernel (not in a terminal IPython, not in plain Python)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def display(obj: Any, **kwargs: Any) -> Any:
    """IPython's `display` (imported here, so that a script never needs IPython)."""
    from IPython.display import display

    return display(obj, **kwargs)


def load_ipywidgets() -> Any:
    """ipywidgets for a dropdown, or None in a script without it (a picker's `value` is then its
    default); in a notebook without it, an ImportError that says what to install."""
    try:
        return __import__("ipywidgets")
    except ImportError:
        if in_notebook():
            raise ImportError(f"the recipe dropdown needs ipywidgets: {INSTALL_HINT}") from None
        return None
