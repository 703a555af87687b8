#define _GNU_SOURCE
/* A process confined by Landlock (file reads only under /usr, and /proc when LL_PROC is set), then reading
   /etc/hostname once a second: prints whether the read was allowed. tests/criu/run.sh checkpoints and restores it
   with CRIU to see whether the restored process keeps its Landlock domain. */
#include <errno.h>
#include <fcntl.h>
#include <linux/landlock.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

int main(void) {
    for (int fd = 3; fd < 1024; fd++) close(fd); /* nothing inherited but stdio */
    struct landlock_ruleset_attr attr = {.handled_access_fs = LANDLOCK_ACCESS_FS_READ_FILE};
    int rs = syscall(SYS_landlock_create_ruleset, &attr, sizeof attr, 0);
    struct landlock_path_beneath_attr pb = {
        .allowed_access = LANDLOCK_ACCESS_FS_READ_FILE,
        .parent_fd = open("/usr", O_PATH | O_CLOEXEC),
    };
    struct landlock_path_beneath_attr proc = {
        .allowed_access = LANDLOCK_ACCESS_FS_READ_FILE,
        .parent_fd = open("/proc", O_PATH | O_CLOEXEC),
    };
    if (rs < 0 || syscall(SYS_landlock_add_rule, rs, LANDLOCK_RULE_PATH_BENEATH, &pb, 0) ||
        (getenv("LL_PROC") && *getenv("LL_PROC") && syscall(SYS_landlock_add_rule, rs, LANDLOCK_RULE_PATH_BENEATH, &proc, 0)) ||
        prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) || syscall(SYS_landlock_restrict_self, rs, 0)) {
        perror("landlock");
        return 1;
    }
    close(rs);
    close(pb.parent_fd);
    close(proc.parent_fd);
    for (int i = 0;; i++) {
        int fd = open("/etc/hostname", O_RDONLY);
        printf("%d %s\n", i, fd >= 0 ? "read-allowed" : strerror(errno));
        fflush(stdout);
        if (fd >= 0) close(fd);
        sleep(1);
    }
}
