"""The deprecation face of the minimal-core layout (molt_core/_moved.py): every old module path
and every moved name still imports for one minor release, warns naming its new home, and is
the very object at the new path."""

import importlib
import sys
import warnings

import pytest

from molt_core import _moved


@pytest.mark.parametrize("old,new", sorted(_moved.MOVED.items()))
def test_an_old_module_path_warns_and_is_the_new_module(old, new):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"^{old} moved to {new}: import it from there"):
        mod = importlib.import_module(old)
    assert mod is importlib.import_module(new)
    assert sys.modules[old] is mod


@pytest.mark.parametrize("module,name,new", sorted((m, n, new) for m, names in _moved.MOVED_NAMES.items()
                                                   for n, new in names.items()))
def test_a_moved_name_warns_and_is_the_object_at_its_new_home(module, name, new):
    with pytest.warns(DeprecationWarning, match=f"^{module}.{name} moved to {new}.{name}"):
        obj = getattr(importlib.import_module(module), name)
    assert obj is getattr(importlib.import_module(new), name)


def test_a_name_that_never_lived_there_is_an_attribute_error_not_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match="module 'molt_core.rewards' has no attribute 'no_such_name'"):
            importlib.import_module("molt_core.rewards").no_such_name
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module("molt_core.no_such_module")
