# sandboxd for local development: the daemon and sandboxctl built from this checkout, run as root in a privileged
# container with the host's cgroups (compose.yaml; README "Docker"). Production runs the systemd unit instead.
#
# Both stages start from Debian trixie (the runtime must have the builder's glibc or newer). Without a registry
# (CI), import a root filesystem under this name first: mmdebstrap --variant=apt trixie - | docker import -
# debian:trixie-slim (.ci/run does).
ARG BASE=debian:trixie-slim

FROM ${BASE} AS runtime
# The embedded host image runs the languages on this image's /usr: python3 and node (sh is there).
# e2fsprogs: volumes are ext4 files (mkfs.ext4), loop-mounted with mount(8).
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 nodejs e2fsprogs mount \
 && rm -rf /var/lib/apt/lists/*
# Token, image skeleton, artifacts, per-execution state.
VOLUME /var/lib/sandboxd
EXPOSE 7070
ENTRYPOINT ["/usr/local/bin/sandboxd"]

# `--target prebuilt`: the binaries of a build already made on a host whose glibc is no newer than trixie's (Debian
# 12 or trixie), put in docker/bin/ first (docker/bin/README.md; the directory is empty otherwise). CI uses it: it has built the daemon for its tests, and building it again in
# here took most of its Docker step. The stages before the target are the only ones the classic builder builds, so
# this one comes before the compiling one.
FROM runtime AS prebuilt
COPY docker/bin/ /usr/local/bin/

FROM ${BASE} AS build
# trixie's rustc is 1.85 and the lockfile needs 1.88 (time 0.3.55, globset 0.4.21): rustc-web and cargo-web are
# Debian's newer toolchain for trixie (1.96), and provide rustc and cargo.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      rustc-web cargo-web gcc libc6-dev pkg-config ca-certificates \
 && rm -rf /var/lib/apt/lists/*
# A network that intercepts TLS needs its CA for cargo (docker/ca-certificates/README.md).
COPY docker/ca-certificates/ /usr/local/share/ca-certificates/
RUN update-ca-certificates
WORKDIR /src
COPY . .
# rust-toolchain.toml pins rustup's channel; there is no rustup here, so it is not read.
# The release profile's optimization, as an argument: CI, which checks that the image builds and serves, builds it
# with little optimization; an image to run is built as it is by default.
ARG CARGO_PROFILE_RELEASE_OPT_LEVEL=3
RUN cargo build --release --locked -p sandboxd -p sandboxctl \
 && install -m755 target/release/sandboxd target/release/sandboxctl /usr/local/bin/

FROM runtime
COPY --from=build /usr/local/bin/sandboxd /usr/local/bin/sandboxctl /usr/local/bin/
