"""A user's model from spec.training.modulePath, and a model that cannot load: a one-line
error naming it, and the pod's exit code that the operator does not retry."""

from __future__ import annotations

import argparse
import json
import os
import sys

import pytest

from tfps.api.semantics import USER_CODE_EXIT_CODE
from tfps.runtime import ps_main
from tfps.runtime.models import UserCodeError, load_model, load_params, use_module_path

GOOD = """
import numpy as np
from tfps.runtime.models import ModelDef, Param


def build(model_args, seed):
    return ModelDef(params=[Param("w", (model_args["n"], 2))], forward=lambda params, features: None)
"""


@pytest.fixture
def module_dir(tmp_path, monkeypatch):
    """A mounted ConfigMap's directory: usercode_pkg/{good,broken,raises}.py."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delenv("PYTHONPATH", raising=False)
    pkg = tmp_path / "usercode_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "good.py").write_text(GOOD)
    (pkg / "broken.py").write_text("def build(model_args, seed)\n    return None\n")
    (pkg / "raises.py").write_text("import missing_dependency_xyz\n")
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("usercode_pkg")]:
        del sys.modules[name]


def test_module_path_finds_the_model_here_and_in_the_ps_child(module_dir):
    use_module_path([str(module_dir)])
    assert sys.path[0] == str(module_dir) and os.environ["PYTHONPATH"] == str(module_dir)
    assert load_model("usercode_pkg.good:build", {"n": 3}).params[0].shape == (3, 2)
    assert load_params("usercode_pkg.good:build", {"n": 4})[0].shape == (4, 2)  # built in a child process


@pytest.mark.parametrize(
    "model, quoted",
    [
        ("usercode_pkg.missing:build", "ModuleNotFoundError: No module named 'usercode_pkg.missing'"),
        ("usercode_pkg.broken:build", "SyntaxError"),
        ("usercode_pkg.raises:build", "No module named 'missing_dependency_xyz'"),
        ("usercode_pkg.good:nothing", "AttributeError"),
        ("usercode_pkg.good:build", "KeyError: 'n'"),  # the function itself raises
    ],
)
def test_a_model_that_cannot_load_is_one_error_naming_it(module_dir, model, quoted):
    use_module_path([str(module_dir)])
    with pytest.raises(UserCodeError) as here:
        load_model(model, {})
    assert str(here.value).startswith(f"model {model}: ") and quoted in str(here.value)
    with pytest.raises(UserCodeError) as child:
        load_params(model, {})
    assert str(child.value) == str(here.value).replace(os.path.realpath(module_dir), str(module_dir))


def test_syntax_error_names_the_file_and_line(module_dir):
    use_module_path([str(module_dir)])
    with pytest.raises(UserCodeError, match=r"broken\.py, line 1\)"):
        load_model("usercode_pkg.broken:build", {})


def test_ps_exits_with_the_user_code_exit_code_and_a_termination_message(module_dir, tmp_path, monkeypatch):
    log = tmp_path / "termination-log"
    training = {"model": "usercode_pkg.raises:build", "modulePath": [str(module_dir)]}
    env = {
        "TF_CONFIG": json.dumps(
            {"cluster": {"ps": ["127.0.0.1:0"], "worker": ["127.0.0.1:0"]}, "task": {"type": "ps", "index": 0}}
        ),
        "TFPS_JOB_NAME": "j",
        "TFPS_NAMESPACE": "ns",
        "TFPS_TRAINING": json.dumps(training),
        "TFPS_TERMINATION_LOG": str(log),
        "KUBERNETES_SERVICE_HOST": "127.0.0.1",  # in a pod: the termination message is written
        "TFPS_SCHED_BATCH": "0",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert ps_main.run(argparse.Namespace(bind=None, metrics_port=None)) == USER_CODE_EXIT_CODE == 4
    message = log.read_text()
    assert message.startswith("model usercode_pkg.raises:build: ModuleNotFoundError")
    assert "missing_dependency_xyz" in message and "raises.py, line 1" in message
