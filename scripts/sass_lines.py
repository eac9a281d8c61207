"""Where a cubin's machine code comes from: instructions per source file and per source line.

Reads `nvdisasm --print-line-info` output on stdin (the cubin must be built with -lineinfo, as
megac's are) and prints, per function, the instruction count per innermost source file, the top
lines, and per outermost call site (the line of the kernel that inlined it). It answers how much
of the kernel's 400+ KB each opcode's code is, for the instruction-cache question (perf-notes,
sessions 42-43).
"""
import collections
import re
import sys

# `//## File "a.cuh", line 12 inlined at "b.cuh", line 34 ...`: innermost first
LOC = re.compile(r'"([^"]+)", line (\d+)')
INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/\s+\S")
FUNC = re.compile(r"^\s*\.text\.(\S+):|Function : (\S+)")


def main(top: int = 30) -> None:
    per_file: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    per_line: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    per_site: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    func, inner, outer = "?", ("?", 0), ("?", 0)
    for line in sys.stdin:
        m = FUNC.search(line)
        if m:
            func = (m.group(1) or m.group(2))[:60]
            continue
        if "//##" in line:
            locs = LOC.findall(line)
            if locs:
                inner = (locs[0][0].rsplit("/", 1)[-1], int(locs[0][1]))
                outer = (locs[-1][0].rsplit("/", 1)[-1], int(locs[-1][1]))
            continue
        if INSTR.search(line):
            per_file[func][inner[0]] += 1
            per_line[func][f"{inner[0]}:{inner[1]}"] += 1
            per_site[func][f"{outer[0]}:{outer[1]}"] += 1
    for func, files in per_file.items():
        total = sum(files.values())
        print(f"== {func}: {total} instructions ({total * 16 / 1024:.0f} KB)")
        for name, n in files.most_common(top):
            print(f"  file {n:7d} {100 * n / total:5.1f}%  {name}")
        for name, n in per_site[func].most_common(top):
            print(f"  site {n:7d} {100 * n / total:5.1f}%  {name}")
        for name, n in per_line[func].most_common(top // 2):
            print(f"  line {n:7d} {100 * n / total:5.1f}%  {name}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 30)
