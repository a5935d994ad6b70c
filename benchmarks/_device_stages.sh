# Sourced by benchmarks/device_session.sh and device_recheck.sh (which set DEADLINE_S and
# START_S): `left` prints the seconds left of the call's budget; `stage NAME CAP_S COMMAND...`
# runs COMMAND (a program: `timeout` cannot run a shell function) for at most min(CAP_S, the
# time left), skips it under 15 s, and returns its exit status.
left() { echo $((DEADLINE_S - ($(date +%s) - START_S))); }
stage() {
    local name=$1 cap=$2 limit rc
    shift 2
    limit=$(left)
    ((limit > cap)) && limit=$cap
    if ((limit < 15)); then
        echo "== $name: skipped ($(left) s left)"
        return 1
    fi
    echo "== $name (limit ${limit} s) at $(($(date +%s) - START_S)) s"
    timeout --kill-after=10 "$limit" "$@"
    rc=$?
    echo "== $name: rc $rc at $(($(date +%s) - START_S)) s"
    return $rc
}
