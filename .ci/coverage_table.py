"""Per-file C coverage table for .ci/coverage (COVERAGE_PER_FILE=1).

Arguments: table-CFG.tsv files, rows "test file <TAB> seconds <TAB> lines file".
Prints, per test file and configuration, its seconds, the C lines it runs and
how many of those no other file (under any configuration) runs.
"""
import sys


def main(tables: list[str]) -> None:
    runs: dict[tuple[str, str], tuple[int, set[tuple[str, str]]]] = {}
    for table in tables:
        cfg = table.rsplit("table-", 1)[1].removesuffix(".tsv")
        with open(table) as rows:
            for row in rows:
                f, secs, path = row.rstrip("\n").split("\t")
                with open(path) as lf:
                    runs[cfg, f] = (int(secs), {(cfg, ln) for ln in lf.read().split()})
    cfgs = sorted({c for c, _ in runs})
    files = sorted({f for _, f in runs})
    every = set().union(*(v[1] for v in runs.values()))
    by_line: dict[str, set[tuple[str, str]]] = {}
    for (cfg, f), (_, lines) in runs.items():
        for _, ln in lines:
            by_line.setdefault(ln, set()).add((cfg, f))
    print(f"{'file':<44}" + "".join(f"{c + ' s':>10}{c + ' lines':>12}{'only it':>9}" for c in cfgs))
    for f in files:
        row = f"{f:<44}"
        for cfg in cfgs:
            secs, lines = runs.get((cfg, f), (0, set()))
            only = sum(1 for _, ln in lines if by_line[ln] == {(cfg, f)})
            row += f"{secs:>10}{len(lines):>12}{only:>9}"
        print(row)
    print(f"C lines run by some file under some configuration: {len({ln for _, ln in every})}")


if __name__ == "__main__":
    main(sys.argv[1:])
