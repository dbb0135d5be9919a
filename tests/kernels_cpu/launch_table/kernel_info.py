#!/usr/bin/env python3
"""Per-kernel facts from the sm_90a cubins of CUDA object files, for the launch recorder and for
comparing the machine code of two builds.

  kernel_info.py info OBJ...        "mangled_name param_bytes registers" per kernel
  kernel_info.py sass OBJ...        the SASS of every kernel, one "== name" header each, with the
                                    names' per-file anonymous-namespace hashes and the encodings
                                    removed, so that two builds of unchanged code compare equal
  kernel_info.py diff A.sass B.sass the kernels that differ (or exist in one only)

Needs cuobjdump and nvdisasm on PATH (pip download nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm).
"""

import re
import subprocess
import sys

ANON = re.compile(r"_GLOBAL__N__[0-9a-f]+_\d+_\w+?_cu_[0-9a-f]{8}")


def run(args):
    return subprocess.run(args, check=True, capture_output=True, text=True).stdout


def info(objs):
    for obj in objs:
        regs = {}
        for m in re.finditer(r"Function (\S+):\n\s+REG:(\d+)", run(["cuobjdump", "-res-usage", obj])):
            regs[m.group(1)] = int(m.group(2))
        elf = run(["cuobjdump", "-elf", obj])
        for sec in re.split(r"\n(?=\.nv\.info\.)", elf):
            m = re.match(r"\.nv\.info\.(\S+)", sec)
            if not m:
                continue
            name = m.group(1)
            size = 0
            for p in re.finditer(r"Offset\s+:\s+0x([0-9a-f]+)\s+Size\s+:\s+0x([0-9a-f]+)", sec):
                size = max(size, int(p.group(1), 16) + int(p.group(2), 16))
            print(name, size, regs.get(name, 0))


def normalise(name):
    return ANON.sub("ANON", name)


def sass(objs):
    for obj in objs:
        text = run(["cuobjdump", "-sass", obj])
        for block in re.split(r"\n\s+Function : ", text)[1:]:
            lines = block.split("\n")
            print("== " + normalise(lines[0].strip()))
            for line in lines[1:]:
                m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;?\s*/\*", line)
                if m:
                    print(normalise(m.group(1)))


def read_sass(path):
    kernels = {}
    name = None
    with open(path) as f:
        for line in f:
            if line.startswith("== "):
                name = line[3:].strip()
                kernels[name] = []
            elif name is not None:
                kernels[name].append(line.rstrip("\n"))
    return kernels


def diff(a_path, b_path):
    a, b = read_sass(a_path), read_sass(b_path)
    same = changed = 0
    for name in sorted(set(a) | set(b)):
        if name not in a:
            print("only in", b_path + ":", name)
        elif name not in b:
            print("only in", a_path + ":", name)
        elif a[name] != b[name]:
            changed += 1
            print("differs:", name, f"({len(a[name])} -> {len(b[name])} instructions)")
        else:
            same += 1
    print(f"{same} kernels identical, {changed} differ, {len(set(a) ^ set(b))} in one build only")


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("info", "sass", "diff"):
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    {"info": info, "sass": sass, "diff": lambda args: diff(*args)}[sys.argv[1]](sys.argv[2:])
