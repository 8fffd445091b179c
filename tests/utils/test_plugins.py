import pytest

from easyvlm.utils.plugins import PluginError, is_plugin_spec, load_plugin, parse_plugin_spec, resolve_plugin_spec


def write(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(body)
    return path


def test_spec_parsing_and_default_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = parse_plugin_spec("rewards/r.py", default_name="compute_score")
    assert spec.path == tmp_path / "rewards" / "r.py" and spec.name == "compute_score"
    assert resolve_plugin_spec("r.py:f") == f"{tmp_path / 'r.py'}:f"
    assert is_plugin_spec("a/b.py:f") and is_plugin_spec("b.py") and not is_plugin_spec("grpo")
    with pytest.raises(PluginError, match="must end in .py"):
        parse_plugin_spec("module:func")
    with pytest.raises(PluginError, match="not a valid Python function name"):
        parse_plugin_spec("r.py:1bad")


def test_load_function_and_module_constants(tmp_path):
    path = write(tmp_path, "reward.py", "REWARD_TYPE = 'sequential'\ndef score(x):\n    return x + 1\n")
    fn, module = load_plugin(f"{path}:score")
    assert fn(1) == 2 and module.REWARD_TYPE == "sequential"


def test_two_files_with_the_same_name_do_not_collide(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = write(tmp_path / "a", "r.py", "def main():\n    return 'a'\n")
    b = write(tmp_path / "b", "r.py", "def main():\n    return 'b'\n")
    assert load_plugin(str(a))[0]() == "a" and load_plugin(str(b))[0]() == "b"


def test_errors_name_file_and_function(tmp_path):
    with pytest.raises(PluginError, match=r"plugin file not found: .*missing\.py"):
        load_plugin(str(tmp_path / "missing.py"))
    path = write(tmp_path, "r.py", "X = 1\ndef other():\n    pass\n")
    with pytest.raises(PluginError, match=r"has no function 'main'; callables defined there: \['other'\]"):
        load_plugin(str(path))
    with pytest.raises(PluginError, match="'X' is a int, not a function"):
        load_plugin(f"{path}:X")
    broken = write(tmp_path, "broken.py", "raise RuntimeError('boom')\n")
    with pytest.raises(PluginError, match=r"importing .*broken\.py failed: RuntimeError: boom"):
        load_plugin(str(broken))


def test_shipped_source_runs_without_the_file(tmp_path):
    """What a worker on another node does: the driver reads the text, the file is not there."""
    import traceback

    from easyvlm.utils.plugins import read_plugin_source

    path = write(tmp_path, "shipped_plugin.py", "import os\ndef main(x: int):\n    return os.path.exists(__file__)\n"
                                                 "def boom():\n    raise ValueError('from the shipped text')\n")
    source = read_plugin_source(f"{path}:main")
    path.unlink()
    fn, module = load_plugin(f"{path}:main", source=source)
    assert fn(1) is False and module.__file__ == str(path)
    assert fn.__annotations__ == {"x": int}  # compiled without the loader's own `from __future__` flags
    with pytest.raises(ValueError) as info:
        load_plugin(f"{path}:boom", source=source)[0]()
    frame = traceback.extract_tb(info.tb)[-1]  # tracebacks name the file and show the shipped line
    assert (frame.filename, frame.line) == (str(path), "raise ValueError('from the shipped text')")
    assert read_plugin_source(str(path)) is None  # unreadable: loading it names the missing file
    with pytest.raises(PluginError, match=r"importing .*broken_shipped\.py failed: NameError"):
        load_plugin(str(tmp_path / "broken_shipped.py"), source="undefined_name\n")
