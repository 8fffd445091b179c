"""The generic Registry behind get_advantage / get_policy_loss (file named to avoid other test_registry.py)."""

import pytest

from easyvlm.algorithms.registry import Registry


def make_registry():
    registry = Registry("widget", "section.widget")

    @registry.register("double")
    def double(x):
        return 2 * x

    return registry


def test_register_get_and_names():
    registry = make_registry()
    fn, is_plugin = registry.get("double")
    assert fn(3) == 6 and not is_plugin
    assert registry.names() == ("double",)


def test_duplicate_and_spec_like_names_are_refused():
    registry = make_registry()
    with pytest.raises(ValueError, match="'double' is already registered"):
        registry.register("double")(lambda x: x)
    with pytest.raises(ValueError, match="looks like a file.py:func spec"):
        registry.register("mine.py:f")(lambda x: x)


def test_unknown_name_lists_names_and_config_key():
    message = r"unknown widget 'tripple' \(config key section\.widget\); registered: \['double'\]"
    with pytest.raises(ValueError, match=message):
        make_registry().get("tripple")
    with pytest.raises(TypeError, match="section.widget must be a string"):
        make_registry().get(3)


def test_plugin_spec_is_loaded_from_file(tmp_path):
    (tmp_path / "w.py").write_text("def main(x):\n    return x + 1\n")
    fn, is_plugin = make_registry().get(str(tmp_path / "w.py"))
    assert fn(1) == 2 and is_plugin
