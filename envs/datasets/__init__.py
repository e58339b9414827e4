"""The SWE datasets as they are published: which dataset a record comes from, what its fields mean here, and the
image it runs in by its dataset's own rule. ``envs.task.Task`` is the one task type they all load into.

The interface (names kept stable; the runners read them from the Task):

- ``DATASETS``: ``agentenv`` (this project's own records and BYO tasks), ``swe-bench`` (full, Lite, Verified;
  4.x rows, and 5.x rows with ``image`` / ``eval_script`` / ``log_parser`` / ``eval_type``), ``swe-gym``,
  ``swe-smith``, ``r2e-gym``, ``swe-rebench`` (``install_config``) and ``swe-bench-extra``;
- ``detect(record)``: the dataset a record comes from, read from its fields (``rules`` says how); a caller that
  knows better names it (``load_tasks(path, dataset=...)``, ``Task.from_json(record, dataset=...)``);
- ``adapt(record, dataset)``: the record in the Task's own field names (what it publishes under other names mapped,
  what it lacks derived: the image by its dataset's rule, SWE-smith's gold fix as the reverse of its bug, R2E-Gym's
  id and gold patch); every published field is kept, the unknown ones in ``Task.metadata``;
- ``image_for(dataset, record)``: the image a record of that dataset runs in when it names none;
- ``record_id(record)``: the id its task gets (R2E-Gym's rows have none: ``<repo_name>__<commit_hash>``);
- ``read_records(source)``: the records of a JSONL / JSON / Parquet file or a Hugging Face ``datasets`` object,
  as plain JSON values (``envs.datasets.files``).

What each dataset's fields become on the Task (``envs.task.Task``):

==================  ==========================================================================================
``dataset``         which dataset the record came from (one of ``DATASETS``)
``image``           SWE-bench 5's ``image``, SWE-smith's ``image_name``, R2E-Gym's ``docker_image``, SWE-rebench
                    V2's ``image_name``; else the dataset's rule (``rules.IMAGE_RULES``)
``patch``           the gold fix, always (SWE-smith: the reverse of its published ``patch``, which introduces the
                    bug; R2E-Gym: the non-test Python files of ``parsed_commit_content``)
``bug_patch``       applied at reset before the agent starts (SWE-smith's published ``patch``); "" otherwise
``eval_script``     SWE-bench 5's eval script, as published; ``eval_type``: its ``pass_and_fail`` / ``fail_only``
``log_parser``      as published (SWE-bench 5, SWE-rebench's ``install_config["log_parser"]``); ``pytest`` for
                    agentenv's own records; "" where the dataset's harness picks it by repository (SWE-bench 4)
``install_config``  SWE-rebench's, as published (``test_cmd``, ``log_parser``, ...)
``expected_output_json``  R2E-Gym's exact map of test -> status, as published (a JSON object in a string)
``hidden_paths``    absolute paths removed from the agent's sandbox at reset and put back for grading only
                    (R2E-Gym: ``/r2e_tests`` and ``/testbed/run_tests.sh``)
==================  ==========================================================================================
"""

from __future__ import annotations

from envs.datasets.files import SourceError, read_records
from envs.datasets.rules import DATASETS, RecordError, adapt, agentenv_image, detect, image_for, record_id

__all__ = ["DATASETS", "RecordError", "SourceError", "adapt", "agentenv_image", "detect", "image_for",
           "read_records", "record_id"]
