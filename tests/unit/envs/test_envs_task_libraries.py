"""Libraries files: an image needs only name, version and sha256; the mutation builder's fields are checked
when it runs; errors name the file, the library and the field; the shipped file keeps its images."""

from __future__ import annotations

import json

import pytest

from envs.tasks import __main__ as cli
from envs.tasks.libraries import LIBRARIES_FILE, LibraryError, load_libraries

SHA = "1e61c37477a1626458e36f7b1d82aa5c9b094fa4802892072e49de9c60c4c926"


def write(tmp_path, libraries, name="libs.json", **top):
    p = tmp_path / name
    p.write_text(json.dumps({**top, "libraries": libraries}))
    return p


def test_an_image_needs_only_name_version_and_sha256(tmp_path):
    [lib] = load_libraries(write(tmp_path, [{"name": "six", "version": "1.16.0", "sha256": SHA}]))
    assert lib.image == "agentenv/swe-six:1.16.0" and lib.pythonpath == "."
    assert lib.wheelhouse == tuple(json.loads(LIBRARIES_FILE.read_text())["wheelhouse"])  # pytest comes along
    assert lib.recipe.requirements == lib.wheelhouse
    with pytest.raises(LibraryError) as e:
        lib.need("tests", "mutate", for_what="search")
    assert e.value.field == "tests" and e.value.library == "six" and "libs.json" in str(e.value)
    assert "needs only name, version and sha256" in str(e.value)


def test_a_repo_names_the_image_like_a_task_record(tmp_path):
    [lib] = load_libraries(write(tmp_path, [{"name": "astropy", "version": "4.3", "sha256": SHA,
                                             "repo": "astropy/astropy"}], wheelhouse=[]))
    assert lib.image == "agentenv/swe-astropy__astropy:4.3" and lib.wheelhouse == ()


@pytest.mark.parametrize(("entry", "field", "words"), [
    ({"version": "1", "sha256": SHA}, "name", "required"),
    ({"name": "six", "sha256": SHA}, "version", "required"),
    ({"name": "six", "version": "1"}, "sha256", "required"),
    ({"name": "six", "version": "1", "sha256": "abc"}, "sha256", "64 lowercase hex"),
    ({"name": "six", "version": "1", "sha256": SHA, "tests": "tests"}, "tests", "list of non-empty strings"),
    ({"name": "six", "version": "1", "sha256": SHA, "pythonpath": "../x"}, "pythonpath", "inside the source"),
])
def test_errors_name_the_library_and_the_field(tmp_path, entry, field, words):
    p = write(tmp_path, [entry])
    with pytest.raises(LibraryError) as e:
        load_libraries(p)
    assert e.value.field == field and words in str(e.value) and f"{p}[0]" in str(e.value)


def test_bad_files_are_named(tmp_path):
    with pytest.raises(LibraryError, match="cannot read"):
        load_libraries(tmp_path / "absent.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(LibraryError, match="not valid JSON"):
        load_libraries(tmp_path / "bad.json")
    entry = {"name": "six", "version": "1", "sha256": SHA}
    with pytest.raises(LibraryError, match="same image"):
        load_libraries(write(tmp_path, [entry, entry]))


def test_the_shipped_libraries_keep_their_images_and_builder_fields():
    libs = load_libraries()
    assert [lib.image for lib in libs] == [f"agentenv/swe-{n}:{v}" for n, v in (
        ("toolz", "0.12.1"), ("more-itertools", "10.5.0"), ("cachetools", "5.5.0"), ("inflection", "0.5.1"),
        ("semver", "3.0.2"), ("boltons", "24.0.0"))]
    for lib in libs:
        assert lib.need("tests", "mutate", "license") is lib
        assert lib.recipe.image == ""  # so the input hash (and the cached image) is what it was


def test_the_commands_read_a_libraries_file_and_report_errors_without_a_traceback(tmp_path, monkeypatch, capsys):
    built = []
    monkeypatch.setattr("envs.images.build_image", lambda recipe, **kw: built.append(recipe.tag) or recipe.tag)
    ok = write(tmp_path, [{"name": "six", "version": "1.16.0", "sha256": SHA}])
    assert cli.main(["images", "--libraries", str(ok)]) == 0
    assert built == ["agentenv/swe-six:1.16.0"]
    bad = write(tmp_path, [{"name": "six", "version": "1.16.0"}], name="bad.json")
    assert cli.main(["images", "--libraries", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "'sha256'" in err and "Traceback" not in err
    assert cli.main(["search", "--libraries", str(ok), "--mutations", str(tmp_path / "m.json")]) == 2
    assert "field 'tests'" in capsys.readouterr().err
    assert cli.main(["build", "--libraries", str(ok)]) == 2  # would overwrite the shipped set
    assert "--out" in capsys.readouterr().err
