#!/usr/bin/env bash
# Mutation testing of the core with mutmut: one module at a time, each against only the fast tests that guard it.
#
#   scripts/mutation.sh                  every module in the table below, one after the other
#   scripts/mutation.sh config queue     just these (names from the table)
#   scripts/mutation.sh --list           the table
#
#   MUTATION_CHILDREN=2   mutants tested in parallel (default 1: the machine's cores are shared)
#   MUTATION_NICE=10      niceness of the run
#   MUTATION_PYTEST_ARGS="-k 'not slow_test'"   more pytest arguments for choosing the tests (word-split)
#   MUTATION_ONLY="simpletuner.config.versions.*"   only these mutants (mutmut's names, fnmatch patterns,
#                         space-separated): a part of a module, scored on its own
#   MUTATION_TIMEOUT_CONSTANT=10   seconds added to a mutant's expected test time before mutmut's limits (x15 wall
#                         clock, x30 CPU; a mutant past them counts as caught). With mutmut's own 1 s a stalled
#                         machine's slow runs counted as caught (3 of config/train.py's 76 timeouts passed every
#                         test when re-run); a change of this value re-tests every mutant that timed out
#   MUTATION_TESTS_FROM=REF   run against the tests/ of git commit REF instead of the work tree's (a "before"
#                         score: the same mutants against the suite as it was; run again without it for "after")
#
# Each module runs in its own scratch copy of the work tree, .mutation/<name>/ (.mutation/<name>-tests-REF/ with
# MUTATION_TESTS_FROM; mutmut keeps its state there, so a
# second run re-tests only what changed). The score of each run is appended to .mutation/scores.tsv and printed:
# killed = mutants a test failed on (or that hung: mutmut's timeouts), of all mutants checked; "no tests" mutants
# (code no selected test runs) count as survivors. .mutation/<name>/survivors.txt lists them. To read one:
#   cd .mutation/<name> && ../../.venv/bin/mutmut results        (every survivor's name)
#   cd .mutation/<name> && ../../.venv/bin/mutmut show NAME      (its diff)
# Not part of CI (.ci/run): a module takes minutes to an hour on this machine. docs/testing.md has the scores.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
VENV="${SIMPLETUNER_VENV:-$REPO/.venv}"
MUTMUT_SPEC="${MUTMUT_SPEC:-mutmut==3.8.1}"
CHILDREN="${MUTATION_CHILDREN:-1}"
NICE="${MUTATION_NICE:-10}"

# name | files to mutate (globs, space-separated) | the tests that guard them (space-separated)
TABLE=(
  "config|simpletuner/config/coerce.py simpletuner/config/versions.py simpletuner/config/train.py simpletuner/config/data.py simpletuner/config/loader.py simpletuner/config/errors.py simpletuner/config/files.py simpletuner/config/families.py simpletuner/config/simpletuner_keys.py simpletuner/config/requirements.py simpletuner/config/cli.py simpletuner/config/wizard.py|tests/config"
  "paths|simpletuner/config/paths.py simpletuner/training/paths.py|tests/config/test_paths.py tests/training/test_run_paths.py tests/security tests/config/test_loader.py"
  "queue|simpletuner/server/queue.py|tests/server/test_queue.py tests/server/test_retry.py"
  "checkpoint|simpletuner/training/checkpoint.py|tests/training/test_checkpoint.py"
  "tread|simpletuner/training/tread.py|tests/training/test_tread.py"
  "cache|simpletuner/data/cache.py|tests/data/test_cache.py"
)

row_of() { local r; for r in "${TABLE[@]}"; do [ "${r%%|*}" = "$1" ] && { echo "$r"; return 0; }; done; return 1; }

if [ "${1:-}" = "--list" ]; then
  for r in "${TABLE[@]}"; do IFS='|' read -r n m t <<<"$r"; printf '%-11s %s\n%-11s   tests: %s\n' "$n" "$m" "" "$t"; done
  exit 0
fi
names=("$@")
[ ${#names[@]} -gt 0 ] || for r in "${TABLE[@]}"; do names+=("${r%%|*}"); done
for n in "${names[@]}"; do row_of "$n" >/dev/null || { echo "unknown module '$n'; see scripts/mutation.sh --list" >&2; exit 2; }; done

[ -x "$VENV/bin/python" ] || bash scripts/install.sh --test
"$VENV/bin/python" -c "import mutmut" 2>/dev/null || "$VENV/bin/python" -m pip install -q "$MUTMUT_SPEC"

extra_args=()
[ -z "${MUTATION_PYTEST_ARGS:-}" ] || eval "extra_args=(${MUTATION_PYTEST_ARGS})"

toml_list() { local out="" x; for x in "$@"; do out+="${out:+, }\"$x\""; done; echo "[$out]"; }

for name in "${names[@]}"; do
  IFS='|' read -r _ mutate tests <<<"$(row_of "$name")"
  read -ra mutate_list <<<"$mutate"
  read -ra test_list <<<"$tests"
  work="$REPO/.mutation/$name${MUTATION_TESTS_FROM:+-tests-$MUTATION_TESTS_FROM}"  # a "before" run keeps its own copy
  mkdir -p "$work"
  # the work tree as git sees it (tracked and untracked-not-ignored files), over the previous copy
  git ls-files -co --exclude-standard -z | tar --null -T - -cf - | tar -xf - -C "$work"
  if [ -n "${MUTATION_TESTS_FROM:-}" ]; then
    rm -rf "$work/tests" && git archive "$MUTATION_TESTS_FROM" tests | tar -xf - -C "$work"
    # a test file the table names that the older suite did not have yet: left out of that run
    kept=(); for t in "${test_list[@]}"; do [ -e "$work/$t" ] && kept+=("$t"); done; test_list=("${kept[@]}")
  fi
  cat >>"$work/pyproject.toml" <<EOF

[tool.mutmut]
source_paths = ["simpletuner"]
only_mutate = $(toml_list "${mutate_list[@]}")
also_copy = ["webui/", "datasets/", "config/", "benchmarks/", "scripts/", "README.md", "docs/"]
pytest_add_cli_args = ["-p", "no:xdist", "-p", "no:cacheprovider", "-q"]
# e2e tests run the code under test in other processes (from the work tree, not the mutated copy): they can kill
# no mutant here, and would only make every survivor slower
pytest_add_cli_args_test_selection = $(toml_list "${test_list[@]}" -m "not e2e and not browser" "${extra_args[@]}")
# torch is not fork-safe: workers fork from a server process that never ran a test
process_isolation = "forkserver"
timeout_constant = ${MUTATION_TIMEOUT_CONSTANT:-10}
use_setproctitle = false
EOF
  echo "==> $name: mutating ${mutate_list[*]} against ${test_list[*]}"
  start=$(date +%s)
  read -ra only <<<"${MUTATION_ONLY:-}"
  (cd "$work" && nice -n "$NICE" "$VENV/bin/mutmut" run --max-children "$CHILDREN" "${only[@]}") \
    || echo "mutmut run exited $? for $name" >&2
  (cd "$work" && "$VENV/bin/python" - "$name" "$(( $(date +%s) - start ))" "$REPO/.mutation/scores.tsv" \
    "${MUTATION_TESTS_FROM:-work tree}" "${only[@]}") <<'EOF'
import collections, fnmatch, json, pathlib, sys, time
from mutmut.stats import status_by_exit_code
name, seconds, table, tests_from, *only = sys.argv[1:]
counts, survivors = collections.Counter(), []
for meta in sorted(pathlib.Path("mutants").rglob("*.py.meta")):
    for key, code in json.loads(meta.read_text())["exit_code_by_key"].items():
        if only and not any(fnmatch.fnmatch(key, p) for p in only):
            continue
        status = status_by_exit_code[code]
        counts[status] += 1
        if status in ("survived", "no tests", "suspicious"):
            survivors.append(f"{status}\t{key}")
pathlib.Path("survivors.txt").write_text("".join(line + "\n" for line in survivors))
killed = counts["killed"] + counts["timeout"] + counts["caught by type check"]
checked = sum(n for status, n in counts.items() if status not in ("not checked", "skipped"))
score = 100.0 * killed / checked if checked else 0.0
line = (f"{name}\t{killed}/{checked}\t{score:.1f}%\tsurvived={counts['survived']}\tno_tests={counts['no tests']}"
        f"\tsuspicious={counts['suspicious']}\tnot_checked={counts['not checked']}\t{seconds}s\ttests={tests_from}"
        f"\tonly={' '.join(only) or 'all'}\t{time.strftime('%Y-%m-%d %H:%M')}")
print(line)
with open(table, "a") as fh:
    fh.write(line + "\n")
EOF
done
