// Command pause stands in for the Kubernetes pause image (registry.k8s.io/pause): the process that
// holds a pod sandbox's namespaces. Like the real one it sleeps until SIGTERM or SIGINT and exits 0;
// it also reaps children, which only matters when a pod shares its PID namespace.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	signals := make(chan os.Signal, 4)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT, syscall.SIGCHLD)
	for sig := range signals {
		if sig != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			pid, err := syscall.Wait4(-1, nil, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
