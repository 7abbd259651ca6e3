// Command allreduce stands in for NVIDIA nccl-tests' all_reduce_perf between two pods on the
// fleet's kubelet nodes, which have no GPUs, NCCL or MPI. It does a real all-reduce (sum) of float32
// buffers over one TCP connection instead: each rank fills its send buffer with rank+1, both ranks
// send the whole buffer while they receive the peer's, and each adds the two element-wise into its
// receive buffer, which must then hold 3 everywhere. Like all_reduce_perf it walks sizes from -b to
// -e by factor -f, times -n iterations per size after -w warm-up ones, reports algbw = bytes/time and
// busbw = algbw * 2(n-1)/n (n = 2, so busbw = algbw), and ends with nccl-tests' two summary lines
// ("# Out of bounds values : N OK|FAILED", "# Avg bus bandwidth    : X"), which it also writes to the
// Kubernetes termination message. What it cannot show is what needs hardware: NVLink, GPUDirect
// RDMA, NCCL's ring and tree algorithms, more than two ranks.
//
// Rank, world size and rendezvous come from torchrun-style environment variables: GPUCANARY_RANK (0
// or 1), GPUCANARY_WORLD_SIZE (2), GPUCANARY_MASTER_ADDR (rank 0's IP, where rank 0 listens),
// GPUCANARY_MASTER_PORT (29500), GPUCANARY_CONNECT_TIMEOUT_S (120) and GPUCANARY_TERMINATION_LOG
// (/dev/termination-log). Exit codes: 0 every value right, 1 wrong values, 2 no peer or a broken
// connection, 4 bad flags or environment.
package main

import (
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net"
	"os"
	"strconv"
	"strings"
	"time"
)

const (
	exitOK         = 0
	exitWrong      = 1
	exitConnection = 2
	exitUsage      = 4
	worldSize      = 2
	floatBytes     = 4
	magic          = 0x47434152 // "GCAR": the first word of the handshake
)

type config struct {
	rank           int
	master         string // host:port rank 0 listens on and rank 1 dials
	connectTimeout time.Duration
	terminationLog string
	minBytes       int64
	maxBytes       int64
	factor         int64
	iters          int
	warmup         int
}

type sizeResult struct {
	bytes, count int64
	timeUs       float64
	algbw, busbw float64
	wrong        int64
}

type usageError struct{ msg string }

func (e usageError) Error() string { return e.msg }

// parseSize reads nccl-tests' sizes: a number with an optional K, M or G suffix (powers of 1024).
func parseSize(text string) (int64, error) {
	original := text
	multiplier := int64(1)
	switch strings.ToUpper(text[len(text)-min(len(text), 1):]) {
	case "K":
		multiplier = 1 << 10
	case "M":
		multiplier = 1 << 20
	case "G":
		multiplier = 1 << 30
	}
	if multiplier > 1 {
		text = text[:len(text)-1]
	}
	value, err := strconv.ParseInt(text, 10, 64)
	if err != nil || value*multiplier < floatBytes {
		return 0, fmt.Errorf("%q is not a size of at least %d bytes (such as 1M)", original, floatBytes)
	}
	return value * multiplier, nil
}

func env(name, fallback string) string {
	if value, ok := os.LookupEnv(name); ok && value != "" {
		return value
	}
	return fallback
}

func parseConfig(args []string) (config, error) {
	flags := flag.NewFlagSet("allreduce", flag.ContinueOnError)
	flags.SetOutput(io.Discard) // one line on stderr from main, not the flag package's usage dump
	minText := flags.String("b", "1M", "smallest size in bytes (K, M, G suffixes)")
	maxText := flags.String("e", "64M", "largest size in bytes (K, M, G suffixes)")
	factor := flags.Int64("f", 2, "multiplication factor between sizes")
	iters := flags.Int("n", 5, "timed iterations per size")
	warmup := flags.Int("w", 1, "warm-up iterations per size")
	if err := flags.Parse(args); err != nil {
		return config{}, usageError{err.Error() + " (flags: -b MIN -e MAX -f FACTOR -n ITERS -w WARMUP)"}
	}
	cfg := config{factor: *factor, iters: *iters, warmup: *warmup,
		terminationLog: env("GPUCANARY_TERMINATION_LOG", "/dev/termination-log")}
	var err error
	if cfg.minBytes, err = parseSize(*minText); err != nil {
		return config{}, usageError{"-b: " + err.Error()}
	}
	if cfg.maxBytes, err = parseSize(*maxText); err != nil {
		return config{}, usageError{"-e: " + err.Error()}
	}
	switch {
	case cfg.maxBytes < cfg.minBytes:
		return config{}, usageError{fmt.Sprintf("-e %d is below -b %d", cfg.maxBytes, cfg.minBytes)}
	case cfg.factor < 2:
		return config{}, usageError{fmt.Sprintf("-f %d: the factor must be at least 2", cfg.factor)}
	case cfg.iters < 1 || cfg.warmup < 0:
		return config{}, usageError{fmt.Sprintf("-n %d -w %d: need at least one iteration and no negative warm-up", cfg.iters, cfg.warmup)}
	}
	return withRendezvous(cfg)
}

func withRendezvous(cfg config) (config, error) {
	rank, err := strconv.Atoi(env("GPUCANARY_RANK", ""))
	if err != nil || rank < 0 || rank >= worldSize {
		return config{}, usageError{fmt.Sprintf("GPUCANARY_RANK=%q: set it to 0 or 1", os.Getenv("GPUCANARY_RANK"))}
	}
	if world := env("GPUCANARY_WORLD_SIZE", ""); world != strconv.Itoa(worldSize) {
		return config{}, usageError{fmt.Sprintf("GPUCANARY_WORLD_SIZE=%q: only a world of 2 ranks is supported", world)}
	}
	addr := net.ParseIP(env("GPUCANARY_MASTER_ADDR", ""))
	if addr == nil || addr.IsUnspecified() {
		return config{}, usageError{fmt.Sprintf("GPUCANARY_MASTER_ADDR=%q: set it to rank 0's IP address", os.Getenv("GPUCANARY_MASTER_ADDR"))}
	}
	port, err := strconv.Atoi(env("GPUCANARY_MASTER_PORT", "29500"))
	if err != nil || port < 1 || port > 65535 {
		return config{}, usageError{fmt.Sprintf("GPUCANARY_MASTER_PORT=%q: not a TCP port", os.Getenv("GPUCANARY_MASTER_PORT"))}
	}
	timeoutS, err := strconv.ParseFloat(env("GPUCANARY_CONNECT_TIMEOUT_S", "120"), 64)
	if err != nil || timeoutS <= 0 {
		return config{}, usageError{fmt.Sprintf("GPUCANARY_CONNECT_TIMEOUT_S=%q: not a positive number of seconds", os.Getenv("GPUCANARY_CONNECT_TIMEOUT_S"))}
	}
	cfg.rank = rank
	cfg.master = net.JoinHostPort(addr.String(), strconv.Itoa(port))
	cfg.connectTimeout = time.Duration(timeoutS * float64(time.Second))
	return cfg, nil
}

// connect returns the one connection between the two ranks: rank 0 accepts it on the master
// address itself (not 0.0.0.0, so it answers only where rank 1 was told to dial), rank 1 dials it
// every 0.5 s until rank 0 is up.
func connect(cfg config) (net.Conn, error) {
	deadline := time.Now().Add(cfg.connectTimeout)
	if cfg.rank == 0 {
		listener, err := net.Listen("tcp", cfg.master)
		if err != nil {
			return nil, fmt.Errorf("rank 0 cannot listen on %s: %w", cfg.master, err)
		}
		defer listener.Close()
		listener.(*net.TCPListener).SetDeadline(deadline)
		conn, err := listener.Accept()
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return nil, fmt.Errorf("rank 0: no connection from rank 1 on %s within %s", cfg.master, cfg.connectTimeout)
		} else if err != nil {
			return nil, fmt.Errorf("rank 0: accepting on %s: %w", cfg.master, err)
		}
		return conn, nil
	}
	for {
		conn, err := net.DialTimeout("tcp", cfg.master, min(time.Until(deadline), 5*time.Second))
		if err == nil {
			return conn, nil
		}
		if time.Until(deadline) < 500*time.Millisecond {
			return nil, fmt.Errorf("rank 1: cannot reach rank 0 at %s within %s: %v", cfg.master, cfg.connectTimeout, err)
		}
		time.Sleep(500 * time.Millisecond)
	}
}

// handshake checks that the peer is the other rank and walks the same sizes, so mismatched flags
// fail at once rather than hang half-way through a buffer.
func handshake(conn net.Conn, cfg config) error {
	hello := func(rank int) [7]int64 {
		return [7]int64{magic, int64(rank), cfg.minBytes, cfg.maxBytes, cfg.factor, int64(cfg.iters), int64(cfg.warmup)}
	}
	conn.SetDeadline(time.Now().Add(cfg.connectTimeout))
	errs := make(chan error, 1)
	go func() { errs <- binary.Write(conn, binary.LittleEndian, hello(cfg.rank)) }()
	var got [7]int64
	if err := errors.Join(binary.Read(conn, binary.LittleEndian, &got), <-errs); err != nil {
		return fmt.Errorf("handshake with the peer failed: %w", err)
	}
	if want := hello(1 - cfg.rank); got != want {
		return fmt.Errorf("the peer is not rank %d with the same -b -e -f -n -w: it sent %v, expected %v", 1-cfg.rank, got, want)
	}
	return nil
}

// allReduce sends all of send while receiving the peer's buffer into recv, then adds send into
// recv element-wise: recv ends as the sum over both ranks, as ncclAllReduce(ncclSum) leaves it.
func allReduce(conn net.Conn, send, recv []byte) error {
	errs := make(chan error, 1)
	go func() { _, err := conn.Write(send); errs <- err }()
	_, readErr := io.ReadFull(conn, recv)
	if err := errors.Join(readErr, <-errs); err != nil {
		return err
	}
	for i := 0; i < len(recv); i += floatBytes {
		sum := math.Float32frombits(binary.LittleEndian.Uint32(send[i:])) + math.Float32frombits(binary.LittleEndian.Uint32(recv[i:]))
		binary.LittleEndian.PutUint32(recv[i:], math.Float32bits(sum))
	}
	return nil
}

func countWrong(recv []byte, want float32) int64 {
	var wrong int64
	for i := 0; i < len(recv); i += floatBytes {
		if math.Float32frombits(binary.LittleEndian.Uint32(recv[i:])) != want {
			wrong++
		}
	}
	return wrong
}

func measure(conn net.Conn, cfg config, bytes int64, send, recv []byte) (sizeResult, error) {
	count := bytes / floatBytes
	bytes = count * floatBytes
	send, recv = send[:bytes], recv[:bytes]
	// Each step has the connect timeout to finish, so a peer that stops answering ends the run.
	step := func() error {
		conn.SetDeadline(time.Now().Add(cfg.connectTimeout))
		return allReduce(conn, send, recv)
	}
	for i := 0; i < cfg.warmup; i++ {
		if err := step(); err != nil {
			return sizeResult{}, err
		}
	}
	var elapsed time.Duration
	for i := 0; i < cfg.iters; i++ {
		start := time.Now()
		if err := step(); err != nil {
			return sizeResult{}, err
		}
		elapsed += time.Since(start)
	}
	seconds := elapsed.Seconds() / float64(cfg.iters)
	algbw := float64(bytes) / seconds / 1e9
	return sizeResult{bytes: bytes, count: count, timeUs: seconds * 1e6, algbw: algbw,
		busbw: algbw * 2 * (worldSize - 1) / worldSize, wrong: countWrong(recv, float32(1+2))}, nil
}

func tableLine(r sizeResult) string {
	return fmt.Sprintf("%12d  %12d  %8s  %6s  %8.2f  %6.2f  %6.2f  %6d", r.bytes, r.count, "float", "sum", r.timeUs, r.algbw, r.busbw, r.wrong)
}

func summary(results []sizeResult) ([]string, int64) {
	var wrong int64
	var busbw float64
	for _, r := range results {
		wrong += r.wrong
		busbw += r.busbw
	}
	verdict := "OK"
	if wrong > 0 {
		verdict = "FAILED"
	}
	return []string{
		fmt.Sprintf("# Out of bounds values : %d %s", wrong, verdict),
		fmt.Sprintf("# Avg bus bandwidth    : %.3f", busbw/float64(len(results))),
	}, wrong
}

// writeTerminationLog leaves the result where `kubectl get pod` shows it (the container's
// terminationMessagePath); outside a pod the file does not exist and nothing is written.
func writeTerminationLog(path string, lines []string) {
	file, err := os.OpenFile(path, os.O_WRONLY|os.O_TRUNC, 0)
	if err != nil {
		return
	}
	defer file.Close()
	_, _ = io.WriteString(file, strings.Join(lines, "\n")+"\n")
}

func run(cfg config) int {
	conn, err := connect(cfg)
	if err == nil {
		defer conn.Close()
		err = handshake(conn, cfg)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "allreduce: error: %v\n", err)
		return exitConnection
	}
	fmt.Fprintf(os.Stderr, "allreduce: rank %d connected (%s <-> %s)\n", cfg.rank, conn.LocalAddr(), conn.RemoteAddr())
	fmt.Printf("# allreduce (nccl-tests all_reduce_perf over TCP) rank %d of %d, master %s\n", cfg.rank, worldSize, cfg.master)
	fmt.Printf("# minBytes %d maxBytes %d step: %d(factor) warmup iters: %d iters: %d validation: 1\n",
		cfg.minBytes, cfg.maxBytes, cfg.factor, cfg.warmup, cfg.iters)
	fmt.Println("#")
	for _, columns := range [][]any{{"size", "count", "type", "redop", "time", "algbw", "busbw", "#wrong"},
		{"(B)", "(elements)", "", "", "(us)", "(GB/s)", "(GB/s)", ""}} {
		fmt.Println(strings.TrimRight(fmt.Sprintf("# %10s  %12s  %8s  %6s  %8s  %6s  %6s  %6s", columns...), " "))
	}
	send, recv := make([]byte, cfg.maxBytes), make([]byte, cfg.maxBytes)
	for i := 0; i < len(send); i += floatBytes {
		binary.LittleEndian.PutUint32(send[i:], math.Float32bits(float32(cfg.rank+1)))
	}
	var results []sizeResult
	for bytes := cfg.minBytes; bytes <= cfg.maxBytes; bytes *= cfg.factor {
		result, err := measure(conn, cfg, bytes, send, recv)
		if err != nil {
			fmt.Fprintf(os.Stderr, "allreduce: error: rank %d lost the peer during the %d-byte all-reduce: %v\n", cfg.rank, bytes, err)
			return exitConnection
		}
		results = append(results, result)
		fmt.Println(tableLine(result))
	}
	lines, wrong := summary(results)
	fmt.Println(strings.Join(lines, "\n"))
	writeTerminationLog(cfg.terminationLog, append([]string{tableLine(results[len(results)-1])}, lines...))
	if wrong > 0 {
		return exitWrong
	}
	return exitOK
}

func main() {
	cfg, err := parseConfig(os.Args[1:])
	if err != nil {
		fmt.Fprintf(os.Stderr, "allreduce: error: %v\n", err)
		os.Exit(exitUsage)
	}
	os.Exit(run(cfg))
}
