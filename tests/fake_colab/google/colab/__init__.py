"""A small fake of `google.colab` for tests (the real one exists only inside Colab).

`google/` has no __init__.py on purpose: it is a namespace package, so `google.protobuf` and the
like still import. Put `tests/fake_colab` on sys.path only in the tests that need it.
"""

from . import drive, files, userdata  # noqa: F401
