#!/usr/bin/env python3
"""scripts/main_job.sh writes only `loraplex generate`'s JSON lines on standard output.

The job runs in a copy of the repository's scripts with every tool it calls replaced by a stub
that writes noise on standard output as the real ones do (apt-get's progress, pip, cmake's
configure and build lines, the FlashInfer and xgrammar checks) and a `build/tools/loraplex` that prints two
JSON lines: standard output must hold exactly those two lines. Nothing is installed or built.

usage: check_main_job_stdout.py REPO_ROOT
"""

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile

ROOT = sys.argv[1]
NOISE = "noise on stdout from"


def write_exe(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


with tempfile.TemporaryDirectory(prefix="loraplex-main-job-") as tmp:
    shutil.copytree(os.path.join(ROOT, "scripts"), os.path.join(tmp, "scripts"))
    # fetch_flashinfer.sh and fetch_xgrammar.sh find their files present (and say so on stdout).
    for name in ("flashinfer", "xgrammar"):
        version = re.search(r"^version=(\S+)", open(os.path.join(ROOT, "scripts",
                                                                f"fetch_{name}.sh")).read(),
                            re.M).group(1)
        os.makedirs(os.path.join(tmp, ".cache", name))
        with open(os.path.join(tmp, ".cache", name, "VERSION"), "w") as f:
            f.write(version)
    stubs = os.path.join(tmp, "stubs")
    # Every package looks missing, so install_deps.sh runs apt-get and pip.
    write_exe(os.path.join(stubs, "dpkg-query"), "#!/bin/sh\nexit 1\n")
    write_exe(os.path.join(stubs, "sudo"), '#!/bin/sh\nexec "$@"\n')
    for tool in ("apt-get", "cmake", "python3", "nproc"):
        out = "2" if tool == "nproc" else f"{NOISE} {tool}"
        write_exe(os.path.join(stubs, tool), f"#!/bin/sh\necho '{out}'\nexit 0\n")
    lines = [{"index": 0, "output_text": "a"}, {"index": 1, "output_text": "b"}]
    write_exe(os.path.join(tmp, "build", "tools", "loraplex"),
              "#!/bin/sh\necho 'progress on stderr' >&2\n" +
              "".join(f"echo '{json.dumps(line)}'\n" for line in lines))
    env = dict(os.environ, PATH=stubs + os.pathsep + os.environ.get("PATH", ""))
    p = subprocess.run(["bash", os.path.join(tmp, "scripts", "main_job.sh")], env=env,
                       capture_output=True, text=True, timeout=120)

failures = []
if p.returncode != 0:
    failures.append(f"exit status {p.returncode}: {p.stderr[-2000:]}")
out = p.stdout.splitlines()
parsed = []
for line in out:
    try:
        parsed.append(json.loads(line))
    except ValueError:
        failures.append(f"a line on stdout is not JSON: {line!r}")
if parsed != lines:
    failures.append(f"stdout is not exactly generate's lines: {out}")
if NOISE not in p.stderr:
    failures.append(f"the set-up output did not reach stderr: {p.stderr[-2000:]}")
for f in failures:
    print("FAIL " + f)
print("PASS main_job.sh: stdout holds only generate's JSON lines" if not failures else
      f"{len(failures)} failed")
sys.exit(1 if failures else 0)
