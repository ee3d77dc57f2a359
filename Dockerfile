# tierckpt daemon image: the node-local checkpoint daemon, no torch (the daemon never imports it).
#
#   docker build -t tierckpt-daemon:0.1.0 .
#   sudo install -d -o 10001 -g 10001 -m 0750 /dev/shm/tierckpt   # the tier dir, owned by the daemon
#   docker run --rm --read-only -v /dev/shm/tierckpt:/dev/shm/tierckpt -p 8474:8474 \
#       tierckpt-daemon:0.1.0 --capacity 2G
#
# Runs as uid/gid 10001 and writes nothing outside the tier directory (TIERCKPT_SHM_DIR, a tmpfs
# hostPath in Kubernetes), so it works with a read-only root filesystem.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TIERCKPT_HOST=0.0.0.0 \
    TIERCKPT_PORT=8474 \
    TIERCKPT_SHM_DIR=/dev/shm/tierckpt

COPY pyproject.toml README.md /tmp/src/
COPY daemon /tmp/src/daemon
COPY core /tmp/src/core
COPY client /tmp/src/client

RUN pip install --no-cache-dir "/tmp/src[daemon]" \
    && rm -rf /tmp/src \
    && groupadd --gid 10001 tierckpt \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin tierckpt

USER 10001:10001

EXPOSE 8474

HEALTHCHECK --interval=30s --timeout=5s --start-period=15s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('TIERCKPT_PORT', '8474'), timeout=4)"]

# umask 0007: the daemon creates shard files with mode 0660 and the trainers (other users in the
# daemon's group) write into them; the default umask 0022 would take away the group's write bit.
ENTRYPOINT ["/bin/sh", "-c", "umask 0007 && exec tierckpt-daemon \"$@\"", "tierckpt-daemon"]
