# Weir in a container: one node, data in the /var/lib/weir volume.
#   docker build --build-arg WEIR_COMMIT=$(git rev-parse --short=12 HEAD) -t weir .
#   docker compose -f deploy/compose.yaml up
# Not built by CI (the build machines have no Docker engine).

# --- build -------------------------------------------------------------------
FROM rust:1-bookworm AS build
# `weir --version` names the commit; there is no .git in the build context.
ARG WEIR_COMMIT=unknown
ENV WEIR_COMMIT=${WEIR_COMMIT}
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p weir-gateway -p weirctl \
    && install -D -m 0755 target/release/weir target/release/weirctl -t /out/

# --- run ---------------------------------------------------------------------
FROM debian:bookworm-slim
RUN groupadd --system --gid 10001 weir \
    && useradd --system --uid 10001 --gid weir --home-dir /var/lib/weir --shell /usr/sbin/nologin weir \
    && install -d -o weir -g weir -m 0750 /var/lib/weir \
    && install -d -m 0755 /etc/weir
COPY --from=build /out/weir /out/weirctl /usr/bin/
COPY --chown=root:weir --chmod=0640 deploy/weir.toml /etc/weir/weir.toml
USER weir
WORKDIR /var/lib/weir
VOLUME ["/var/lib/weir"]
# AMQP, MQTT, MQTT over WebSocket, HTTP (management API, /metrics, dashboard).
EXPOSE 5672 1883 8083 15672
# Logs go to stdout; `docker stop` sends SIGTERM: connections get
# connection.close 320 and the store is flushed before exit.
STOPSIGNAL SIGTERM
# Healthy when the AMQP and HTTP listeners accept connections (the
# image has bash, not curl).
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
    CMD ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/5672 && exec 4<>/dev/tcp/127.0.0.1/15672"]
ENTRYPOINT ["/usr/bin/weir"]
CMD ["--config", "/etc/weir/weir.toml"]
