package main

import (
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

func pidFile(conf netConf, id string) string {
	return filepath.Join(conf.DataDir, conf.Name, "forwarder-"+id+".pid")
}

func logFile(conf netConf, id string) string {
	return filepath.Join(conf.DataDir, conf.Name, "forwarder-"+id+".log")
}

// startForwarder puts the Service's address on the pod's lo and starts `forward` as a process of its own,
// detached from the runtime's pipes, which would otherwise wait for it.
func startForwarder(conf netConf, id, netns string) error {
	host, _, err := net.SplitHostPort(conf.APIServer.Service)
	if err != nil {
		return fmt.Errorf("apiServer.service %q: %w", conf.APIServer.Service, err)
	}
	if err := inNetns(netns, "addr", "add", host+"/32", "dev", "lo"); err != nil {
		return err
	}
	self, err := os.Executable()
	if err != nil {
		return err
	}
	log, err := os.OpenFile(logFile(conf, id), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer log.Close()
	cmd := exec.Command(self, "forward", netns, conf.APIServer.Service, conf.APIServer.Upstream)
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return err
	}
	return os.WriteFile(pidFile(conf, id), []byte(strconv.Itoa(cmd.Process.Pid)+"\n"), 0o644)
}

func stopForwarder(conf netConf, id string) {
	raw, err := os.ReadFile(pidFile(conf, id))
	if err != nil {
		return
	}
	if pid, err := strconv.Atoi(strings.TrimSpace(string(raw))); err == nil {
		_ = syscall.Kill(pid, syscall.SIGTERM)
	}
	os.Remove(pidFile(conf, id))
	os.Remove(logFile(conf, id))
}

// forward listens on `listen` inside the network namespace `netns` and carries each connection to `upstream`
// in the namespace it was started in: a socket keeps the namespace it was made in, so only the listener is
// made in the pod's.
func forward(netns, listen, upstream string) error {
	listener, err := listenIn(netns, listen)
	if err != nil {
		return err
	}
	for {
		conn, err := listener.Accept()
		if err != nil {
			return err
		}
		go func() {
			defer conn.Close()
			up, err := net.Dial("tcp", upstream)
			if err != nil {
				fmt.Fprintln(os.Stderr, "dial", upstream+":", err)
				return
			}
			defer up.Close()
			done := make(chan struct{}, 2)
			go func() { io.Copy(up, conn); done <- struct{}{} }()
			go func() { io.Copy(conn, up); done <- struct{}{} }()
			<-done
		}()
	}
}

func listenIn(netns, address string) (net.Listener, error) {
	runtime.LockOSThread() // this thread alone enters the pod's namespace; it is never unlocked, so it dies with it
	own, err := os.Open("/proc/thread-self/ns/net")
	if err != nil {
		return nil, err
	}
	defer own.Close()
	pod, err := os.Open(netns)
	if err != nil {
		return nil, err
	}
	defer pod.Close()
	if err := setns(pod); err != nil {
		return nil, fmt.Errorf("enter %s: %w", netns, err)
	}
	listener, listenErr := net.Listen("tcp", address)
	if err := setns(own); err != nil {
		return nil, fmt.Errorf("leave %s: %w", netns, err)
	}
	return listener, listenErr
}

func setns(f *os.File) error {
	return unix.Setns(int(f.Fd()), unix.CLONE_NEWNET)
}
