# Sourced by .ci/run: start a private PostgreSQL server (Debian's `postgresql` package; initdb
# and pg_ctl as an unprivileged user, loopback only, stopped when CI exits) and export
# HEXISEQ_TEST_POSTGRESQL_URL so the store, shared-study and concurrency tests run against it.
# Where the package cannot be installed those tests skip and say why.
ci_postgres_start() {
  local apt_get=(apt-get)
  [ "$(id -u)" -eq 0 ] || apt_get=(sudo -n apt-get)
  if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
    "${apt_get[@]}" install -y -qq postgresql >/dev/null 2>&1 ||
      { "${apt_get[@]}" update -qq >/dev/null 2>&1 &&
        "${apt_get[@]}" install -y -qq postgresql >/dev/null 2>&1; } ||
      { echo "ci: postgresql could not be installed; the PostgreSQL tests will skip"; return 0; }
  fi
  local bin
  bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
  local user=hexiseq-ci-pg
  if [ "$(id -u)" -eq 0 ]; then
    id "$user" >/dev/null 2>&1 || useradd --system --no-create-home "$user"
  else
    user=$(id -un)
  fi
  CI_PG_DATA=$(mktemp -d /tmp/hexiseq-ci-pg.XXXXXX)
  chown "$user" "$CI_PG_DATA"
  local port=55432
  local as_user=(env)
  [ "$(id -u)" -eq 0 ] && as_user=(runuser -u "$user" --)
  if ! "${as_user[@]}" "$bin/initdb" -D "$CI_PG_DATA/data" -A trust -U hexiseq >/dev/null ||
    ! "${as_user[@]}" "$bin/pg_ctl" -D "$CI_PG_DATA/data" -l "$CI_PG_DATA/log" -w \
      -o "-c listen_addresses=127.0.0.1 -p $port -k $CI_PG_DATA" start >/dev/null; then
    echo "ci: the private PostgreSQL server did not start; the PostgreSQL tests will skip"
    rm -rf "$CI_PG_DATA"
    unset CI_PG_DATA
    return 0
  fi
  CI_PG_STOP=("${as_user[@]}" "$bin/pg_ctl" -D "$CI_PG_DATA/data" -m fast -w stop)
  trap 'ci_postgres_stop' EXIT
  export HEXISEQ_TEST_POSTGRESQL_URL="postgresql+psycopg://hexiseq@127.0.0.1:$port/postgres"
  echo "ci: private PostgreSQL on 127.0.0.1:$port"
}

ci_postgres_stop() {
  [ -n "${CI_PG_DATA:-}" ] || return 0
  "${CI_PG_STOP[@]}" >/dev/null 2>&1 || true
  rm -rf "$CI_PG_DATA"
}
