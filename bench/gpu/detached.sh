#!/usr/bin/env bash
# A GPU run longer than one device call: started in a session of its own (setsid), it outlives the call that
# started it while the machine stays warm (the next call must come within the idle window). Each call waits
# for it only as long as it needs: it returns as soon as the run ends, not after a fixed sleep.
#   bash bench/gpu/detached.sh start NAME COMMAND...   start COMMAND (a string for bash -c), then wait
#   bash bench/gpu/detached.sh wait NAME [PATH...]     wait again (a later call)
# Both wait up to WAIT seconds (default 540: a call may run 600), print the log's tail, and once the run has
# ended copy its log, its exit status and every PATH (files or directories; globs expanded by the caller) to
# $OUT/NAME/ (default OUT=/tmp/prism-gpu). Exit status: the run's once it ended, 75 while it still runs.
# Example (issue 18's checkpoint run, ~16 min):
#   call 1: bash bench/gpu/detached.sh start ck 'MODES=checkpoint HOST_GIB=210 OUT=/tmp/ck bash bench/gpu/admission.sh'
#   call 2: bash bench/gpu/detached.sh wait ck /tmp/ck /tmp/admission-checkpoint.logs
set -uo pipefail
usage() { sed -n '2,12p' "$0" >&2; exit 2; }
[ $# -ge 2 ] || usage
what=$1 name=$2
shift 2
case $name in *[!A-Za-z0-9_-]*|"") echo "detached.sh: NAME must be letters, digits, - or _: got '$name'" >&2; exit 2;; esac
dir=/tmp/detached-$name
out=${OUT:-/tmp/prism-gpu}/$name
case $what in
  start)
    [ $# -ge 1 ] || usage
    if [ -e "$dir/pid" ] && [ ! -e "$dir/rc" ]; then
      echo "detached.sh: '$name' is already running (pid $(cat "$dir/pid")); use: detached.sh wait $name" >&2; exit 2
    fi
    rm -rf "$dir" && mkdir -p "$dir"
    printf '%s\n' "$*" > "$dir/command"
    setsid bash -c 'bash -c "$1" > "$2/log" 2>&1; echo $? > "$2/rc.tmp"; mv "$2/rc.tmp" "$2/rc"' _ "$*" "$dir" \
      < /dev/null > /dev/null 2>&1 &
    echo $! > "$dir/pid"
    echo "detached.sh: started '$name' (pid $(cat "$dir/pid")): $*"
    ;;
  wait)
    [ -d "$dir" ] || { echo "detached.sh: no run named '$name' on this machine (a fresh machine forgot it)" >&2; exit 2; }
    ;;
  *) usage ;;
esac
t0=$SECONDS
wait_s=${WAIT:-540}
while [ ! -e "$dir/rc" ] && [ $((SECONDS - t0)) -lt "$wait_s" ]; do sleep 5; done
echo "detached.sh: '$name' after $((SECONDS - t0)) s of this call:"
tail -n 20 "$dir/log" 2>/dev/null
if [ ! -e "$dir/rc" ]; then
  echo "detached.sh: '$name' still runs; call 'bash bench/gpu/detached.sh wait $name ...' again within the idle window"
  exit 75
fi
mkdir -p "$out"
cp "$dir/log" "$dir/rc" "$dir/command" "$out/"
for p in "$@"; do
  [ -e "$p" ] && cp -r "$p" "$out/" || echo "detached.sh: $p is not there, not copied" >&2
done
echo "detached.sh: '$name' ended with exit $(cat "$dir/rc"); copied to $out"
exit "$(cat "$dir/rc")"
