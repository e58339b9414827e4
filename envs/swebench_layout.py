"""SWE-bench's image layout, built offline: the repository at /testbed, a ``testbed`` environment at /opt/miniconda3.

SWE-bench's images (and SWE-Gym's, SWE-rebench's) hold a conda installation at ``/opt/miniconda3`` with an
environment ``testbed`` that has the repository's dependencies and the repository installed; their eval scripts
start with ``source /opt/miniconda3/bin/activate`` and ``conda activate testbed``, and ``/root/.bashrc`` activates it
for interactive shells. Conda cannot be installed offline here, so this layout stands in for it, and says so:

- ``/opt/miniconda3/envs/testbed`` is a Python venv of the image's interpreter (``python3 -m venv --without-pip``),
  its dependencies installed from the host's wheelhouse (``pip --python``: the venv itself has no pip, so an eval
  script's ``python -m pip install -e .`` fails at once instead of reaching for a network it does not have), and the
  repository made importable by a ``.pth`` file (what an editable install does);
- ``/opt/miniconda3`` itself is the ``base`` environment (``bin/python`` is the image's ``python3``) and is first on
  ``PATH``, as in SWE-bench's images: a plain ``python`` is the base one, the testbed's needs activating;
- ``/opt/miniconda3/bin/activate`` and ``etc/profile.d/conda.sh`` define a shell function ``conda`` that does
  ``activate [NAME]`` and ``deactivate`` (``PATH``, ``CONDA_PREFIX``, ``CONDA_DEFAULT_ENV``), safe under ``set -u``;
  ``/opt/miniconda3/bin/conda`` answers ``run -n NAME CMD...``, ``env list`` and ``info --envs``; nothing else of
  conda's (``install``, ``create``) exists, and asking for it says so.

The repository is one commit of the sdist (the task's ``base_commit``, fixed author and dates: the same hash on
every machine). git is configured with ``log.showRoot false``, so that an eval script's ``git show`` prints that
commit's header, not the whole repository as a diff (SWE-bench's images have a real history, where it is one
commit's diff).

``DOCKERFILE`` is built by ``envs.images.build_image`` for a recipe with ``layout="swebench"``; ``context_files`` are
the stand-in's files, written into the build context.
"""

from __future__ import annotations

ROOT = "/opt/miniconda3"
ENV = "testbed"
ENV_PYTHON = f"{ROOT}/envs/{ENV}/bin/python"

# sourced (by bin/activate, .bashrc, eval scripts): POSIX sh, every variable read with a default (eval scripts run
# under `set -u`)
CONDA_SH = r"""# agentenv's stand-in for conda (no conda offline): see envs/swebench_layout.py in agentenv
export CONDA_EXE=/opt/miniconda3/bin/conda
conda() {
  case "${1-}" in
    activate)
      _ae_name=${2:-base}
      if [ "$_ae_name" = base ]; then _ae_prefix=/opt/miniconda3; else _ae_prefix=/opt/miniconda3/envs/$_ae_name; fi
      if [ ! -x "$_ae_prefix/bin/python" ]; then
        echo "EnvironmentNameNotFound: Could not find conda environment: $_ae_name" >&2; return 1
      fi
      conda deactivate
      PATH="$_ae_prefix/bin:$PATH"
      export PATH CONDA_PREFIX="$_ae_prefix" CONDA_DEFAULT_ENV="$_ae_name" CONDA_SHLVL=1
      ;;
    deactivate)
      if [ -n "${CONDA_PREFIX-}" ] && [ "${CONDA_PREFIX-}" != /opt/miniconda3 ]; then
        PATH=$(printf '%s' ":$PATH:" | sed "s#:${CONDA_PREFIX}/bin:#:#; s#^:##; s#:\$##")
        export PATH
      fi
      unset CONDA_PREFIX CONDA_DEFAULT_ENV
      ;;
    *) "$CONDA_EXE" "$@" ;;
  esac
}
"""

ACTIVATE_SH = r""". /opt/miniconda3/etc/profile.d/conda.sh
conda activate "${1:-base}"
"""

CONDA_BIN = r"""#!/bin/sh
# agentenv's stand-in for conda's command (no conda offline): see envs/swebench_layout.py in agentenv
case "${1-}" in
  run)
    shift; name=base
    while [ $# -gt 0 ]; do
      case "$1" in
        -n|--name) name=$2; shift 2 ;;
        --no-capture-output|--live-stream) shift ;;
        *) break ;;
      esac
    done
    if [ "$name" = base ]; then prefix=/opt/miniconda3; else prefix=/opt/miniconda3/envs/$name; fi
    [ -x "$prefix/bin/python" ] || { echo "EnvironmentNameNotFound: Could not find conda environment: $name" >&2; exit 1; }
    PATH="$prefix/bin:$PATH" CONDA_PREFIX=$prefix CONDA_DEFAULT_ENV=$name exec "$@" ;;
  env|info)
    echo "# conda environments (agentenv's stand-in for conda):"
    echo "base                     /opt/miniconda3"
    for d in /opt/miniconda3/envs/*/; do [ -x "$d/bin/python" ] && printf '%-24s %s\n' "$(basename "$d")" "${d%/}"; done
    ;;
  activate|deactivate)
    echo "conda $1 is a shell function: source /opt/miniconda3/bin/activate first" >&2; exit 1 ;;
  *)
    echo "agentenv's stand-in for conda knows: activate, deactivate, run -n NAME CMD..., env list; not '${1-}'" >&2
    exit 2 ;;
esac
"""

BASHRC = "source /opt/miniconda3/etc/profile.d/conda.sh && conda activate testbed\n"

DOCKERFILE = """\
FROM {base}
ENV {env} PYTHONDONTWRITEBYTECODE=1 PATH=/opt/miniconda3/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
COPY wheels /tmp/wheels
COPY miniconda3 /opt/miniconda3
RUN chmod 755 /opt/miniconda3/bin/conda && ln -s /usr/bin/python3 /opt/miniconda3/bin/python \\
 && ln -s /usr/bin/python3 /opt/miniconda3/bin/python3 \\
 && python3 -m venv --without-pip /opt/miniconda3/envs/testbed \\
 && {install} cp /opt/miniconda3/bashrc /root/.bashrc && rm -rf /tmp/wheels /root/.cache /opt/miniconda3/bashrc
RUN printf '{excludes}' > /etc/gitignore \\
 && git config --system core.excludesFile /etc/gitignore \\
 && git config --system init.defaultBranch main \\
 && git config --system advice.detachedHead false \\
 && git config --system safe.directory '*' \\
 && git config --system log.showRoot false
COPY src /testbed
WORKDIR /testbed
RUN echo /testbed/{pythonpath} > "$(/opt/miniconda3/envs/testbed/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/testbed.pth" \\
 && git init -q && git add -A && git commit -q -m '{repo} {version}'
"""


def install_command(requirements: str) -> str:
    """The Dockerfile's install of the wheelhouse into the testbed venv (``""`` when there is nothing to install)."""
    if not requirements:
        return ""
    return (f"python3 -m pip --python {ENV_PYTHON} install --no-index --find-links /tmp/wheels "
            f"--no-warn-script-location -q {requirements} &&")


def context_files() -> dict[str, tuple[str, int]]:
    """The stand-in's files in the build context: path under the context -> (text, mode)."""
    return {"miniconda3/etc/profile.d/conda.sh": (CONDA_SH, 0o644), "miniconda3/bin/activate": (ACTIVATE_SH, 0o644),
            "miniconda3/bin/conda": (CONDA_BIN, 0o755), "miniconda3/bashrc": (BASHRC, 0o644)}


def instance_image(instance_id: str) -> str:
    """SWE-bench's name for an instance's image: ``swebench/sweb.eval.x86_64.<id, "__" -> "_1776_">:latest``
    (lowercased, as Docker needs)."""
    return f"swebench/sweb.eval.x86_64.{instance_id.replace('__', '_1776_').lower()}:latest"
