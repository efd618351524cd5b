#!/usr/bin/env bash
# Prints where the test run's time went, per group, from nextest's JUnit report:
#
#   bash deploy/test-times.sh [target/nextest/default/junit.xml]
#
# A group is a test binary's unit tests (`lib`, `bin`) or one module under tests/ (`chaos`,
# `faults`, ...). Tests run side by side, so a group has two times: `span`, from the start of
# its first test to the end of its last (its wall time in this run), and `sum`, the sum of its
# tests' own times (what it would take run alone, one at a time). `longest` is its slowest test.
set -euo pipefail
report=${1:-target/nextest/default/junit.xml}
[[ -f "$report" ]] || { echo "test-times: no report at $report" >&2; exit 1; }
# One line per test: group, start (epoch seconds), duration (s), name.
rows=$(grep -o '<testcase [^>]*>' "$report" | sed -E \
    's/.*name="([^"]*)".*classname="([^"]*)".*timestamp="([^"]*)".*time="([^"]*)".*/\2 \1 \3 \4/')
[[ -n "$rows" ]] || { echo "test-times: no test cases in $report" >&2; exit 1; }
starts=$(awk '{print $3}' <<<"$rows" | date -f - +%s.%N)
paste -d' ' <(awk '{print $1, $2, $4}' <<<"$rows") <(echo "$starts") | awk '
{
    binary = $1; name = $2; dur = $3 + 0; start = $4 + 0
    if (binary ~ /::main$/) { split(name, part, "::"); group = part[1] }
    else if (binary ~ /::bin\//) group = "bin (unit)"
    else group = "lib (unit)"
    n[group]++; sum[group] += dur
    if (!(group in first) || start < first[group]) first[group] = start
    if (!(group in last) || start + dur > last[group]) last[group] = start + dur
    if (dur > max[group]) { max[group] = dur; slowest[group] = name }
    if (t0 == "" || start < t0) t0 = start
    if (start + dur > t1) t1 = start + dur
    total += dur; count++
}
END {
    printf "%-14s %5s %8s %8s  %s\n", "group", "tests", "span s", "sum s", "longest (s)"
    for (g in n) order[g] = sum[g]
    while (length(order) > 0) {
        best = ""; for (g in order) if (best == "" || order[g] > order[best]) best = g
        printf "%-14s %5d %8.0f %8.0f  %s (%.0f)\n", best, n[best], last[best] - first[best], sum[best], slowest[best], max[best]
        delete order[best]
    }
    printf "%-14s %5d %8.0f %8.0f\n", "all", count, t1 - t0, total
}'
