# shellcheck shell=bash
# Phases with timing, for scripts that run several long steps (.ci/run).
# Source it, then:
#
#   phase NAME COMMAND [ARG...]
#       Prints "==> phase NAME", runs COMMAND, prints "<== phase NAME: N s"
#       (with "FAILED (exit RC)" after it when COMMAND fails), records the
#       duration and the result, and returns COMMAND's status.
#   phase_skip NAME REASON
#       Records NAME as not run, so the table still lists it.
#   phase_table
#       Prints every recorded phase's duration and result, and the total.
#   run COMMAND [ARG...]
#       Prints "+ COMMAND ARG..." (shell-quoted), then runs it: long phases
#       show what they are doing.
#
# COMMAND may be a shell function. Bash ignores `set -e` inside a function
# called where its status is tested (as `phase` does), so a function with
# several steps must pass failures on itself (`a || rc=$?`, `a && b`).

_phase_names=()
_phase_seconds=()
_phase_results=()
_phase_started=$(date +%s)

run() {
    printf '+'
    printf ' %q' "$@"
    printf '\n'
    "$@"
}

phase() {
    local name=$1 start rc=0 took
    shift
    echo "==> phase $name"
    start=$(date +%s)
    "$@" || rc=$?
    took=$(($(date +%s) - start))
    _phase_names+=("$name")
    _phase_seconds+=("$took")
    if [ "$rc" -eq 0 ]; then
        _phase_results+=(ok)
        echo "<== phase $name: $took s"
    else
        _phase_results+=("FAILED (exit $rc)")
        echo "<== phase $name: $took s, FAILED (exit $rc)"
    fi
    return "$rc"
}

phase_skip() {
    _phase_names+=("$1")
    _phase_seconds+=("-")
    _phase_results+=("not run: $2")
    echo "--- phase $1: not run: $2"
}

# mm:ss for a number of seconds; "-" stays "-".
_phase_clock() {
    case $1 in
        *[!0-9]* | '') echo "$1" ;;
        *) printf '%d:%02d' $(($1 / 60)) $(($1 % 60)) ;;
    esac
}

_phase_join() {
    local out=$1 x
    shift
    for x in "$@"; do out="$out, $x"; done
    echo "$out"
}

phase_table() {
    local i total failed=() skipped=() verdict=ok
    total=$(($(date +%s) - _phase_started))
    echo
    printf '%-16s %8s %7s  %s\n' phase seconds 'm:ss' result
    for i in "${!_phase_names[@]}"; do
        printf '%-16s %8s %7s  %s\n' "${_phase_names[$i]}" "${_phase_seconds[$i]}" \
            "$(_phase_clock "${_phase_seconds[$i]}")" "${_phase_results[$i]}"
        case ${_phase_results[$i]} in
            ok) ;;
            not\ run*) skipped+=("${_phase_names[$i]}") ;;
            *) failed+=("${_phase_names[$i]}") ;;
        esac
    done
    [ "${#failed[@]}" -eq 0 ] || verdict="FAILED: $(_phase_join "${failed[@]}")"
    [ "${#skipped[@]}" -eq 0 ] || verdict="$verdict; not run: $(_phase_join "${skipped[@]}")"
    printf '%-16s %8s %7s  %s\n' total "$total" "$(_phase_clock "$total")" "${verdict#ok; }"
}
