"""`pier serve PATH`: what each kind of PATH is taken for, the repository of one made for it, and
the refusals that say what was expected (server/repository/single_model.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pier.repository import single_model
from pier.repository.single_model import classify, make_repository


def _hf(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    return folder


def test_a_hugging_face_folder_is_served_by_the_llm_backend_under_its_name(tmp_path: Path) -> None:
    served = classify(_hf(tmp_path / "SmolLM2-135M-Instruct"))
    assert (served.kind, served.name) == (single_model.HF, "SmolLM2-135M-Instruct")
    repo = make_repository(served, tmp_path / "run")
    model = repo / "SmolLM2-135M-Instruct"
    assert (model / "config.pbtxt").read_text() == 'backend: "llm"\n'
    assert (model / "1").resolve() == served.path and (model / "1" / "config.json").is_file()


def test_served_model_name_renames_it(tmp_path: Path) -> None:
    assert classify(_hf(tmp_path / "m"), "chat").name == "chat"
    with pytest.raises(ValueError, match="cannot name a model"):
        classify(tmp_path / "m", "a/b")


def test_an_onnx_file_is_served_from_a_version_folder_of_links(tmp_path: Path) -> None:
    (tmp_path / "resnet.onnx").write_bytes(b"onnx")
    served = classify(tmp_path / "resnet.onnx")
    assert (served.kind, served.name) == (single_model.ONNX, "resnet")
    repo = make_repository(served, tmp_path / "run")
    assert (repo / "resnet" / "config.pbtxt").read_text() == 'platform: "onnxruntime_onnx"\n'
    assert (repo / "resnet" / "1" / "model.onnx").read_bytes() == b"onnx"


def test_a_model_folder_and_a_repository(tmp_path: Path) -> None:
    model = tmp_path / "repo" / "simple"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text('platform: "onnxruntime_onnx"\n')
    served = classify(model)
    assert (served.kind, served.name) == (single_model.MODEL, "simple")
    assert (make_repository(served, tmp_path / "run") / "simple" / "config.pbtxt").is_file()
    repo = classify(tmp_path / "repo")
    assert (repo.kind, repo.name) == (single_model.REPOSITORY, "")
    assert make_repository(repo, tmp_path / "run2") == repo.path
    with pytest.raises(ValueError, match="keep their names"):
        classify(tmp_path / "repo", "other")


def test_a_gguf_file_or_a_folder_holding_one_is_served_by_the_llm_backend(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "smol.gguf").write_bytes(b"GGUF")
    served = classify(tmp_path / "m" / "smol.gguf")
    assert (served.kind, served.name) == (single_model.GGUF, "smol")
    model = make_repository(served, tmp_path / "run") / "smol"
    assert (model / "config.pbtxt").read_text() == 'backend: "llm"\n'
    assert (model / "1" / "smol.gguf").resolve() == (tmp_path / "m" / "smol.gguf").resolve()
    folder = classify(tmp_path / "m")
    assert (folder.kind, folder.name) == (single_model.HF, "m")


@pytest.mark.parametrize(("files", "message"), [
    ({"notes.txt": b""}, "must be an .onnx model or a .gguf file"),
])
def test_files_it_cannot_serve_are_refused_with_the_way_round(tmp_path: Path, files: dict, message: str) -> None:
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError, match=message):
            classify(tmp_path / name)


def test_folders_it_cannot_serve_say_what_was_expected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such file or folder"):
        classify(tmp_path / "missing")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text("{}")
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"weights as \*\.safetensors"):
        classify(tmp_path / "bin")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not a Hugging Face model folder"):
        classify(tmp_path / "empty")


def test_the_run_repository_goes_away_and_leaves_the_model(tmp_path: Path) -> None:
    served = classify(_hf(tmp_path / "m"))
    with single_model.repository(served) as repo:
        assert (repo / "m" / "1" / "config.json").is_file()
    assert not repo.exists() and (tmp_path / "m" / "config.json").is_file()
