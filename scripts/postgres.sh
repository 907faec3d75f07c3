#!/usr/bin/env bash
# PostgreSQL + pgvector for lycheemem's PostgreSQL backend work (issue #35), on a Debian 12
# machine as root, without systemd:
#   scripts/postgres.sh install      PostgreSQL 15 from Debian, pgvector 0.8.0 built from Debian
#                                    trixie's source package (bookworm has none); idempotent
#   scripts/postgres.sh start DIR    a throwaway cluster in DIR (socket in DIR/sock, port 5433,
#                                    trust auth, fsync off); prints its connection URL;
#                                    --durable: fsync on (PostgreSQL's default), for benchmarks
#   scripts/postgres.sh stop DIR     stops it
# The system apt lists are not touched: the trixie source entry lives in a private folder.
set -euo pipefail

PG=15
PORT="${LYCHEEMEM_PG_PORT:-5433}"
BIN="/usr/lib/postgresql/$PG/bin"

die() { echo "postgres.sh: $*" >&2; exit 1; }

install() {
    [ "$(id -u)" = 0 ] || die "install needs root"
    if [ ! -x "$BIN/initdb" ] || [ ! -d "/usr/include/postgresql/$PG/server" ]; then
        apt-get install -y -q "postgresql-$PG" "postgresql-server-dev-$PG" >/dev/null \
            || die "apt-get install postgresql-$PG postgresql-server-dev-$PG failed"
    fi
    if [ -f "/usr/share/postgresql/$PG/extension/vector.control" ]; then
        echo "pgvector already installed"
        return
    fi
    local work lists
    work="$(mktemp -d)"
    lists="$work/apt"
    trap 'rm -rf "$work"' RETURN
    mkdir -p "$lists/lists/partial" "$lists/sources.list.d"
    echo "deb-src http://deb.debian.org/debian trixie main" > "$lists/sources.list"
    local opts=(-o APT::Sandbox::User=root -o "Dir::Etc::SourceList=$lists/sources.list"
                -o "Dir::Etc::SourceParts=$lists/sources.list.d"
                -o "Dir::State::Lists=$lists/lists")
    apt-get "${opts[@]}" update -q >/dev/null || die "apt-get update of the trixie source list failed"
    (cd "$work" && apt-get "${opts[@]}" source --download-only pgvector >/dev/null) \
        || die "apt-get source pgvector failed"
    (cd "$work" && dpkg-source -x --no-check pgvector_*.dsc src >/dev/null) \
        || die "unpacking pgvector failed"
    make -C "$work/src" PG_CONFIG="$BIN/pg_config" OPTFLAGS= >/dev/null \
        || die "building pgvector failed"
    make -C "$work/src" PG_CONFIG="$BIN/pg_config" install >/dev/null \
        || die "installing pgvector failed"
    echo "pgvector $(sed -n 's/^default_version = .\(.*\).$/\1/p' "/usr/share/postgresql/$PG/extension/vector.control") installed"
}

start() {
    local dir="${1:?usage: postgres.sh start DIR [--durable]}"
    # A throwaway test cluster skips fsync; --durable keeps PostgreSQL's default (benchmarks).
    local fsync="-c fsync=off"
    [ "${2:-}" = "--durable" ] && fsync=""
    [ -x "$BIN/initdb" ] || die "PostgreSQL $PG is not installed (run: postgres.sh install)"
    mkdir -p "$dir/sock"
    chown -R postgres: "$dir"
    if [ ! -f "$dir/data/PG_VERSION" ]; then
        runuser -u postgres -- "$BIN/initdb" -A trust --no-sync -U postgres -D "$dir/data" >/dev/null
    fi
    runuser -u postgres -- "$BIN/pg_ctl" -w -D "$dir/data" -l "$dir/log" \
        -o "-k $dir/sock -p $PORT $fsync -c listen_addresses=''" start >/dev/null \
        || die "the cluster did not start; see $dir/log"
    PGOPTIONS="-c client_min_messages=warning" runuser -u postgres -- psql -h "$dir/sock" -p "$PORT" -U postgres -q \
        -c "CREATE EXTENSION IF NOT EXISTS vector" postgres >/dev/null \
        || die "CREATE EXTENSION vector failed (run: postgres.sh install)"
    echo "postgresql://postgres@/postgres?host=$dir/sock&port=$PORT"
}

stop() {
    local dir="${1:?usage: postgres.sh stop DIR}"
    runuser -u postgres -- "$BIN/pg_ctl" -w -D "$dir/data" stop -m fast >/dev/null
}

case "${1:-}" in
    install) install ;;
    start) start "${2:-}" "${3:-}" ;;
    stop) stop "${2:-}" ;;
    *) die "usage: postgres.sh install | start DIR [--durable] | stop DIR" ;;
esac
