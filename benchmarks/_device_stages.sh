# Sourced by benchmarks/device_session.sh and device_recheck.sh. `begin LOG DEADLINE_S` sets
# OUT (default /tmp/device-out), the call's budget (DEADLINE_S, overridable by the environment)
# and its start, and tees all output to $OUT/LOG. `left` prints the seconds left of the call's budget; `stage NAME CAP_S COMMAND...`
# runs COMMAND (a program: `timeout` cannot run a shell function) for at most min(CAP_S, the
# time left), skips it under 15 s, and returns its exit status. `install_wheels` installs the
# carried wheels and this checkout of hexiseq under /tmp and puts them on PYTHONPATH and PATH.
begin() {
    OUT=${OUT:-/tmp/device-out}
    mkdir -p "$OUT"
    DEADLINE_S=${DEADLINE_S:-$2}
    START_S=$(date +%s)
    exec > >(tee -a "$OUT/$1") 2>&1
}
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
install_wheels() {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || return 1
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade \
        --target /tmp/hexiseq-site . || return 1
    export PYTHONPATH=/tmp/site:/tmp/hexiseq-site PYTHONUNBUFFERED=1
    export PATH=/tmp/hexiseq-site/bin:$PATH
}
