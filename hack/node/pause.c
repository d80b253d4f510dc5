/* The pod sandbox's process (the pause container): hold the pod's namespaces, reap orphans,
   exit on SIGINT or SIGTERM. Built static by hack/node-images.sh, since no registry can be
   reached to pull registry.k8s.io/pause. */
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

static void down(int sig) { (void)sig; _exit(0); }

static void reap(int sig) {
  (void)sig;
  while (waitpid(-1, 0, WNOHANG) > 0) {
  }
}

int main(void) {
  signal(SIGINT, down);
  signal(SIGTERM, down);
  signal(SIGCHLD, reap);
  for (;;) pause();
}
