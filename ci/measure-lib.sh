# Shared pieces of the ci/measure-*.sh scripts (sourced, not run).
#
#   measure_init [WORKDIR]   sets $kiln (KILN_BIN, default target/release/kiln) and $work
#                            (WORKDIR, default a new mktemp -d; made absolute)
#   measure_run NAME CMD...  runs CMD with stdout to $work/NAME.out and stderr to
#                            $work/NAME.err; on failure prints the tail of the error log and
#                            exits 1
#   measure_secs             seconds since the epoch, with nanoseconds (for wall times)

measure_init() {
  kiln=${KILN_BIN:-target/release/kiln}
  work=${1:-$(mktemp -d)}
  mkdir -p "$work"
  work=$(cd "$work" && pwd)
}

measure_run() {
  local name=$1
  shift
  "$@" >"$work/$name.out" 2>"$work/$name.err" || {
    local rc=$?
    echo "measure: $name failed (exit $rc); see $work/$name.err" >&2
    tail -20 "$work/$name.err" >&2
    exit 1
  }
}

measure_secs() {
  date +%s.%N
}
