// The vireo binary on bad input: each case exits non-zero with one line naming what is wrong,
// never a crash. Plus the happy paths of run / logits / info.
#include <gtest/gtest.h>

#include <filesystem>
#include <sstream>

#include "io/json_file.h"
#include "io/npy.h"
#include "test_helpers.h"

using namespace vireo;
using namespace vireo::test;
namespace fs = std::filesystem;

namespace {

const std::string kFixture = std::string(VIREO_FIXTURES_DIR) + "/glm_dsa_full_f32";

// A copy of the f32 fixture whose model.safetensors header is passed through `edit`.
struct MutableModel {
  TempDir dir{"model"};
  MutableModel() {
    for (const auto& e : fs::directory_iterator(kFixture)) fs::copy(e.path(), dir.path / e.path().filename());
  }
  std::string st() const { return dir / "model.safetensors"; }
  void edit_header(const std::function<void(Json&)>& edit) {
    std::string bytes = read_file(st());
    uint64_t n = 0;
    for (int i = 0; i < 8; ++i) n |= uint64_t(uint8_t(bytes[size_t(i)])) << (8 * i);
    Json h = Json::parse(bytes.substr(8, n));
    edit(h);
    std::string header = h.dump();
    std::string out(8, '\0');
    for (int i = 0; i < 8; ++i) out[size_t(i)] = char((header.size() >> (8 * i)) & 0xff);
    write_file(st(), out + header + bytes.substr(8 + n));
  }
};

std::string logits_cmd(const std::string& dir, const std::string& tokens = "1,2,3") {
  return "logits --model " + dir + " --tokens " + tokens + " --out " + dir + "/out.npy";
}

}  // namespace

TEST(CliErrors, MissingTensor) {
  MutableModel m;
  m.edit_header([](Json& h) { h.erase("model.layers.1.self_attn.kv_b_proj.weight"); });
  expect_clean_error(run_vireo(logits_cmd(m.dir.str())), "missing tensor model.layers.1.self_attn.kv_b_proj.weight");
}

TEST(CliErrors, WrongShape) {
  MutableModel m;
  m.edit_header([](Json& h) {
    auto& s = h["model.layers.0.self_attn.o_proj.weight"]["shape"];
    std::swap(s[0], s[1]);  // same byte size, transposed shape
  });
  expect_clean_error(run_vireo(logits_cmd(m.dir.str())), "tensor model.layers.0.self_attn.o_proj.weight has shape");
}

TEST(CliErrors, TruncatedShard) {
  MutableModel m;
  fs::resize_file(m.st(), fs::file_size(m.st()) - 1000);
  expect_clean_error(run_vireo(logits_cmd(m.dir.str())), "truncated safetensors file");
}

TEST(CliErrors, UnknownDtype) {
  MutableModel m;
  m.edit_header([](Json& h) { h["model.norm.weight"]["dtype"] = "F4_E2M1"; });
  expect_clean_error(run_vireo(logits_cmd(m.dir.str())), "unknown dtype F4_E2M1");
}

TEST(CliErrors, MalformedConfigJson) {
  MutableModel m;
  std::string cfg = read_file(m.dir / "config.json");
  write_file(m.dir / "config.json", cfg.substr(0, cfg.size() / 2));
  expect_clean_error(run_vireo(logits_cmd(m.dir.str())), "config.json: malformed JSON");
}

TEST(CliErrors, UnknownModelType) {
  MutableModel m;
  Json cfg = read_json_file(m.dir / "config.json");
  cfg["model_type"] = "llama";
  write_file(m.dir / "config.json", cfg.dump());
  expect_clean_error(run_vireo(logits_cmd(m.dir.str())), "unknown model_type 'llama'");
}

// A malformed tokenizer.json: one error line naming the file and the value (its JSON path, or
// the field and what a token id must be).
TEST(CliErrors, MalformedTokenizerJson) {
  TempDir d{"tok"};
  const std::string demo = std::string(VIREO_SOURCE_DIR) + "/models/vireo-demo/tokenizer.json";
  Json tok = read_json_file(demo);
  tok["added_tokens"][3]["special"] = "yes";
  write_file(d / "tokenizer.json", tok.dump());
  expect_clean_error(run_vireo("tokenize -m " + d.str() + " hi"), "(/added_tokens/3/special) type must be boolean");
  EXPECT_NE(run_vireo("tokenize -m " + d.str() + " hi").err.find(d.str() + "/tokenizer.json"), std::string::npos);
  tok = read_json_file(demo);
  tok["model"]["vocab"]["hello"] = -5;
  write_file(d / "tokenizer.json", tok.dump());
  expect_clean_error(run_vireo("tokenize -m " + d.str() + " hi"),
                     "model.vocab[\"hello\"] must be a token id in [0, 4194304), got -5");
}

TEST(CliErrors, TokenIdBeyondVocab) {
  expect_clean_error(run_vireo("run --model " + kFixture + " --prompt-ids 1,99999999 -n 2"),
                     "token id 99999999 is out of range");
  expect_clean_error(run_vireo("run --model " + kFixture + " --prompt-ids 1,x -n 2"), "'x' is not a token id");
}

TEST(CliErrors, FastMathNeedsCuda) {
  // The CPU has no fast mode: the flag is refused, not silently ignored, on every command taking it.
  TempDir d{"math"};
  for (const std::string& cmd :
       {std::string("run --prompt-ids 1,2 -n 2"), "logits --tokens 1,2 --out " + d.str() + "/l.npy", std::string("info")})
    expect_clean_error(run_vireo(cmd + " --model " + kFixture + " --math fast"), "--math fast needs --device cuda");
  expect_clean_error(run_vireo("run --prompt-ids 1,2 -n 2 --model " + kFixture + " --math fast-fp8"),
                     "--math fast-fp8 needs --device cuda");
}

TEST(CliErrors, MissingModelDirectory) {
  expect_clean_error(run_vireo("info --model /nonexistent/model"), "/nonexistent/model");
}

TEST(Cli, RunPrintsTheGreedyContinuation) {
  Json e = read_json_file(kFixture + "/expected.json");
  std::string prompt, want;
  for (int id : e["greedy_prompt"]) prompt += (prompt.empty() ? "" : ",") + std::to_string(id);
  std::vector<int> cont = e["greedy_new"];
  for (size_t i = 0; i < 8; ++i) want += (i ? "," : "") + std::to_string(cont[i]);
  RunResult r = run_vireo("run --model " + kFixture + " --prompt-ids " + prompt + " -n 8");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, want + "\n");
  EXPECT_NE(r.err.find("tok/s"), std::string::npos);
}

TEST(Cli, LogitsWritesNpyInBothModes) {
  TempDir d("logits");
  Json e = read_json_file(kFixture + "/expected.json");
  std::string toks;
  std::vector<int> ids = e["tokens"];
  for (size_t i = 0; i < 20; ++i) toks += (i ? "," : "") + std::to_string(ids[i]);
  for (std::string mode : {"prefill", "decode"}) {
    RunResult r = run_vireo("logits --model " + kFixture + " --tokens " + toks + " --mode " + mode + " --out " + (d / "x.npy"));
    ASSERT_EQ(r.exit_code, 0) << r.err;
    NpyArray a = read_npy_f32(d / "x.npy");
    NpyArray want = read_npy_f32(kFixture + "/logits.npy");
    ASSERT_EQ(a.shape[0], 20);
    ASSERT_EQ(a.shape[1], want.shape[1]);
    double num = 0, den = 0;
    for (size_t i = 0; i < a.data.size(); ++i) {
      num += double(a.data[i] - want.data[i]) * (a.data[i] - want.data[i]);
      den += double(want.data[i]) * want.data[i];
    }
    EXPECT_LE(std::sqrt(num / den), 1e-4) << mode;
  }
}

TEST(Cli, InfoDescribesTheSchedule) {
  RunResult r = run_vireo("info --model " + std::string(VIREO_FIXTURES_DIR) + "/glm_dsa_shared_f32");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("glm_moe_dsa"), std::string::npos);
  EXPECT_NE(r.out.find("active per token"), std::string::npos);
  EXPECT_NE(r.out.find("layer   3  "), std::string::npos);
  EXPECT_NE(r.out.find("S\n"), std::string::npos);  // a shared indexer layer
}

TEST(Cli, BadFlagsAreRejected) {
  RunResult r = run_vireo("run --model " + kFixture + " --prompt-ids 1 --top-p 0");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("top_p"), std::string::npos) << r.err;
  expect_clean_error(run_vireo("run --model " + kFixture + " --prompt-ids 1 --frequency-penalty 3"),
                     "frequency_penalty must be in [-2, 2], got 3");
  expect_clean_error(run_vireo("run --model " + kFixture + " --prompt-ids 1 --repetition-penalty 1.2 --mtp"),
                     "--mtp: the penalties (--repetition-penalty");
  expect_clean_error(run_vireo("chat --model " + kFixture + " --presence-penalty 0.5 --mtp"),
                     "--mtp: the penalties (--repetition-penalty");
  r = run_vireo("run --model " + kFixture + " --prompt-ids 1 --logit-bias 13=-100,x=2");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_EQ(count_lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("--logit-bias: 'x=2' is not ID=BIAS"), std::string::npos) << r.err;
  r = run_vireo("run --model " + kFixture + " --prompt-ids 1,2 -n 3 --logit-bias 77=-100,77=100");  // the last one
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("77,77,77"), std::string::npos) << r.out;
  r = run_vireo("bench");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("--model DIR or --synthetic"), std::string::npos) << r.err;
  // bench flags that need the resident CUDA bench, refused elsewhere with one line each.
  const std::pair<const char*, const char*> refused[] = {
      {"--profile", "--profile needs --device cuda"},                        // the profile is the CUDA backend's
      {"--profile-mode queued", "--profile-mode needs --profile"},           // a mode of that profile
      {"--profiler-range prefill", "--profiler-range needs --device cuda"},  // brackets CUDA runs
      {"--device cuda --gpu-budget 1G --profiler-range prefill",
       "--profiler-range needs --device cuda without --gpu-budget"},
      {"--batch 4", "--batch needs --device cuda"},           // batched decode is timed on CUDA
      {"--capacity 4096", "--capacity needs --device cuda"},  // sizes the CUDA decode's cache
      {"--device cuda --decode 64 --capacity 70",
       "--capacity 70: the context-0 decode needs at least --decode + 8 = 72 rows"},
      {"--device cuda --attention absorbed", "--attention chooses the CPU bench's attention path"},
      {"--device cuda --gpu-budget 1G --context 4096", "--context: the streaming bench (--gpu-budget)"},
  };
  for (const auto& [flags, message] : refused) {
    SCOPED_TRACE(flags);
    expect_clean_error(run_vireo("bench --model " + kFixture + " " + flags), message);
  }
  // Values out of a flag's range, refused by the parser with one line naming the flag and where
  // the flags are listed.
  const std::pair<const char*, const char*> out_of_range[] = {
      {"--device cuda --profiler-range steps", "--profiler-range"},
      {"--profile --profile-mode fast", "--profile-mode"},
      {"--batch 0", "--batch"},
      {"--synthetic glm5", "--model excludes --synthetic"}};
  for (const auto& [flags, name] : out_of_range) {
    r = run_vireo("bench --model " + kFixture + " " + flags);
    EXPECT_NE(r.exit_code, 0) << flags;
    EXPECT_EQ(count_lines(r.err), 1) << r.err;
    EXPECT_EQ(r.err.rfind("vireo: error: ", 0), 0u) << r.err;
    EXPECT_NE(r.err.find(name), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("(vireo bench --help lists the flags)"), std::string::npos) << r.err;
  }
  r = run_vireo("bench --help");  // help is not an error
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_NE(r.out.find("--synthetic"), std::string::npos) << r.out;
}

// A flag the command does not have is named as typed, with the flag most likely meant; words
// that are not flags are listed in the order typed; --threads works after the command too.
TEST(Cli, UnknownFlagsNameTheFlagMeant) {
  const std::pair<std::string, std::string> cases[] = {
      {"run --model " + kFixture + " --prompt-ids 1 --temperature 0.8",
       "unknown flag --temperature (did you mean --temp?) in '--temperature 0.8' (vireo run --help lists the flags)"},
      {"run --model " + kFixture + " --prompt-ids 1 --top_p=0.9", "unknown flag --top_p (did you mean --top-p?)"},
      {"serve --model " + kFixture + " --max-batchs 4", "unknown flag --max-batchs (did you mean --max-batch?)"},
      {"info --model " + kFixture + " --frobnicate", "unknown flag --frobnicate (vireo info --help lists the flags)"},
      {"run --model " + kFixture + " --prompt-ids 1 one two", "unexpected arguments: one two (vireo run --help"},
      {"--thread 2 info --model " + kFixture, "unknown flag --thread (did you mean --threads?)"}};
  for (const auto& [args, message] : cases) {
    SCOPED_TRACE(args);
    const RunResult r = run_vireo(args);
    EXPECT_EQ(r.signal, 0);
    EXPECT_NE(r.exit_code, 0);
    EXPECT_EQ(count_lines(r.err), 1) << r.err;
    EXPECT_EQ(r.err.rfind("vireo: error: ", 0), 0u) << r.err;
    EXPECT_NE(r.err.find(message), std::string::npos) << r.err;
  }
  const RunResult r = run_vireo("info --model " + kFixture + " --threads 1");
  EXPECT_EQ(r.exit_code, 0) << r.err;
}

// serve --reasoning-parser needs <think> / </think> tokens: refused before the server listens
// where the model has no tokenizer (the f32 fixture) or is synthetic; --chat-template must load.
TEST(Cli, ServeRefusesTextOptionsItCannotServe) {
  expect_clean_error(run_vireo("serve --model " + kFixture + " --port 0 --reasoning-parser glm45"),
                     "--reasoning-parser glm45: the model has no tokenizer.json");
  expect_clean_error(run_vireo("serve --synthetic glm5 --port 0 --reasoning-parser deepseek_r1"),
                     "--reasoning-parser needs a model with a tokenizer (--model), not --synthetic");
  // --chat-template: a file that is not there, or a template that does not parse, before listening.
  const std::string demo = std::string(VIREO_SOURCE_DIR) + "/models/vireo-demo";
  expect_clean_error(run_vireo("serve --model " + demo + " --port 0 --chat-template /nonexistent.jinja"),
                     "--chat-template /nonexistent.jinja: /nonexistent.jinja: no such template file");
  vireo::test::TempDir t("tmpl");
  vireo::test::write_file(t / "bad.jinja", "{% if %}");
  const RunResult bad = run_vireo("serve --model " + demo + " --port 0 --chat-template " + (t / "bad.jinja"));
  expect_clean_error(bad, "--chat-template " + (t / "bad.jinja"));
}

// tools/ab-bench.sh reads `vireo bench`'s decode lines: two variants, two rounds each, interleaved,
// then one median line a variant with a percentage; a bad variant is refused by name.
// An executable shell script: a stand-in for vireo in the tools' tests.
static std::string write_script(const std::string& path, const std::string& text) {
  {
    std::ofstream f(path);
    f << "#!/bin/sh\n" << text;
  }
  std::filesystem::permissions(path, std::filesystem::perms::owner_all);
  return path;
}

// tools/kernel-costs.sh against a stand-in for the CUDA bench (no GPU here): the kernels listed
// by a VIREO_SKIP_KERNELS=none run, one run a kernel with it dropped, each one's tok/s and the
// time it saves a step and a layer; a run that fails is reported, the rest go on.
TEST(Cli, KernelCostsToolTimesEachKernelDropped) {
  TempDir tmp("kc");
  const std::string fake = write_script(
      tmp / "fake-vireo",
      "case \"$VIREO_SKIP_KERNELS\" in\n"
      "  none) for k in rope_kernel moe_route_kernel gemv_rows2_kernel rope_kernel random_bf16_kernel; do\n"
      "          echo \"VIREO_SKIP_KERNELS: launching $k (_Z3$k)\" >&2; done\n"
      "        [ -n \"$FAKE_NO_GRAPH\" ] || for k in gemv_rows2_kernel rope_kernel moe_route_kernel; do\n"
      "          echo \"VIREO_SKIP_KERNELS: launching $k (_Z3$k) in a recorded graph\" >&2; done; T0=400; T4=250 ;;\n"
      "  rope_kernel) T0=500; T4=250 ;;\n"
      "  '') T0=400; T4=250\n"  // the unchanged bench; FAKE_VARY: 400, 500, 400, ... at context 0
      "      if [ -n \"$FAKE_VARY\" ]; then n=$(cat \"$FAKE_VARY\" 2>/dev/null || echo 0); echo $((n + 1)) >\"$FAKE_VARY\"\n"
      "        [ $((n % 2)) = 1 ] && T0=500; fi ;;\n"
      "  moe_route_kernel) echo 'error: CUDA error: an illegal memory access was encountered' >&2; exit 1 ;;\n"
      "  *) T0=400; T4=250 ;;\n"
      "esac\n"
      "echo \"decode ctx 0       greedy/device   $T0.00 tok/s  6.022 GB/token     3201 GB/s  =  75.1% of copy "
      "bandwidth\"\n"
      "echo \"decode ctx 4096    greedy/device   $T4.00 tok/s  6.076 GB/token     2795 GB/s  =  65.7% of copy "
      "bandwidth\"\n");
  auto sh = [&](const std::string& args, int& code, const std::string& env = "") {
    const std::string cmd = env + "VIREO=" + fake + " bash " + std::string(VIREO_SOURCE_DIR) +
                            "/tools/kernel-costs.sh " + args + " >" + (tmp / "out") + " 2>" + (tmp / "err");
    const int status = std::system(cmd.c_str());
    code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    return read_file(tmp / "out");
  };
  int code = -1;
  std::string out = sh("-r 2 -o " + (tmp / "runs") + " -- --layers 8", code);
  ASSERT_EQ(code, 0) << out << read_file(tmp / "err");
  // Only the recorded step's kernels: random_bf16_kernel ran outside it (setup).
  EXPECT_NE(out.find("kernels launched in the recorded decode step: gemv_rows2_kernel moe_route_kernel rope_kernel\n"),
            std::string::npos)
      << out;
  EXPECT_EQ(out.find("random_bf16_kernel"), std::string::npos) << out;
  EXPECT_NE(out.find("(unchanged)                       ctx 0 400.0 tok/s  ctx 4096 250.0 tok/s"), std::string::npos)
      << out;
  EXPECT_NE(out.find("(its spread over 2 rounds)        ctx 0 0 us (0.0 a layer)  ctx 4096 0 us (0.0 a layer)"),
            std::string::npos)
      << out;
  // 1e6 / 400 - 1e6 / 500 = 500 us a step, 62.5 a layer of 8.
  EXPECT_NE(out.find("rope_kernel                       ctx 0 500.0 tok/s saved 500 us (62.5 a layer)  ctx 4096 250.0 "
                     "tok/s saved 0 us (0.0 a layer)"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("moe_route_kernel                  failed: error: CUDA error: an illegal memory access"),
            std::string::npos)
      << out;
  // With no recorded step (--no-graph), every kernel the run launched.
  out = sh("-r 1 -o " + (tmp / "runs-ng") + " -- --no-graph", code, "FAKE_NO_GRAPH=1 ");
  ASSERT_EQ(code, 0) << out << read_file(tmp / "err");
  EXPECT_NE(out.find("kernels launched (no recorded decode step, so every kernel of the run): gemv_rows2_kernel "
                     "moe_route_kernel random_bf16_kernel rope_kernel\n"),
            std::string::npos)
      << out;
  out = sh("-r 1 -o " + (tmp / "runs2") + " rope_kernel -- --device cuda", code);  // named: no listing run
  ASSERT_EQ(code, 0) << out << read_file(tmp / "err");
  EXPECT_EQ(out.find("kernels launched"), std::string::npos) << out;
  EXPECT_EQ(out.find("spread"), std::string::npos) << out;  // one round: no spread to tell
  EXPECT_NE(out.find("rope_kernel                       ctx 0 500.0 tok/s saved 500 us  ctx 4096"), std::string::npos)
      << out;  // no --layers: no column a layer
  // Rounds of the unchanged bench at 400, 500, 400 tok/s: 1e6 / 400 - 1e6 / 500 = 500 us apart.
  out = sh("-r 3 -o " + (tmp / "runs3") + " rope_kernel -- --layers 8", code, "FAKE_VARY=" + (tmp / "count") + " ");
  ASSERT_EQ(code, 0) << out << read_file(tmp / "err");
  EXPECT_NE(out.find("(unchanged)                       ctx 0 400.0 tok/s"), std::string::npos) << out;
  EXPECT_NE(out.find("(its spread over 3 rounds)        ctx 0 500 us (62.5 a layer)  ctx 4096 0 us"), std::string::npos)
      << out;
  out = sh("-h", code);  // the script's leading comments, not its code
  EXPECT_EQ(code, 0);
  EXPECT_EQ(out.rfind("What each CUDA kernel costs", 0), 0u) << out;
  EXPECT_EQ(out.find("ROUNDS="), std::string::npos) << out;
  sh("rope-kernel", code);
  EXPECT_EQ(code, 2);
  EXPECT_NE(read_file(tmp / "err").find("'rope-kernel' is not a kernel name"), std::string::npos);
}

// tools/gpu-check.sh against stand-ins for the carried binaries: its summary counts each test's
// own result line (a failing DemoModel test counts, the closing lists are not counted twice),
// runs the read probe and both benches.
TEST(Cli, GpuCheckSummarizesTestsProbeAndBench) {
  TempDir tmp("gc");
  std::filesystem::create_directories(tmp / "root/tools");
  std::filesystem::create_directories(tmp / "root/.devcarry/bin");
  std::filesystem::copy_file(std::string(VIREO_SOURCE_DIR) + "/tools/gpu-check.sh", tmp / "root/tools/gpu-check.sh");
  const std::string bin = tmp / "root/.devcarry/bin";
  write_script(bin + "/vireo_tests",
               "case \"$*\" in\n"
               "  *NormsRopeElementwise*) echo '[  PASSED  ] 1 test.'; exit 0 ;;\n"
               "esac\n"
               "echo \"$*\" >\"$(dirname \"$0\")/tests_args\"\n"
               "cat <<'E'\n"
               "[       OK ] CudaOps.A (3 ms)\n"
               "tests/x.cpp:1: Failure\n"
               "[  FAILED  ] DemoModel.B (5 ms)\n"
               "[  SKIPPED ] CudaBench.C (0 ms)\n"
               "[       OK ] Branches.D (1 ms)\n"
               "[  PASSED  ] 2 tests.\n"
               "[  SKIPPED ] 1 test, listed below:\n"
               "[  SKIPPED ] CudaBench.C\n"
               "[  FAILED  ] 1 test, listed below:\n"
               "[  FAILED  ] DemoModel.B\n"
               "E\n"
               "exit 1\n");
  write_script(bin + "/vireo", "echo \"decode ctx 0  stand-in $*\"\n");
  write_script(bin + "/vireo_read_probe", "echo 'flat, one buffer  4357 GB/s'\n");
  const std::string cmd = "GPU_CHECK_NO_LINK=1 OUT=" + (tmp / "out") + " bash " + (tmp / "root/tools/gpu-check.sh") +
                          " --layers 3 >" + (tmp / "stdout") + " 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << read_file(tmp / "stdout");
  const std::string summary = read_file(tmp / "out/summary.txt"), out = read_file(tmp / "stdout");
  EXPECT_NE(summary.find("binaries: carried prebuilt"), std::string::npos) << summary;
  EXPECT_NE(summary.find("tests: 2 passed, 1 failed, 1 skipped"), std::string::npos) << summary;
  EXPECT_NE(read_file(bin + "/tests_args").find("Branches.*"), std::string::npos);
  EXPECT_NE(summary.find("read probe: rc 0"), std::string::npos) << summary;
  EXPECT_NE(out.find("--- read probe\nflat, one buffer  4357 GB/s"), std::string::npos) << out;
  EXPECT_NE(summary.find("bench fp8: rc 0"), std::string::npos) << summary;
  EXPECT_NE(out.find("stand-in bench --device cuda --synthetic glm5 --dtype fp8 --decode 128 --layers 3"),
            std::string::npos)
      << out;
}

TEST(Cli, AbBenchToolReadsTheBenchOutput) {
  TempDir tmp("ab");
  auto sh = [&](const std::string& args, RunResult& r) {
    const std::string cmd = "VIREO=" + std::string(VIREO_BIN) + " bash " + std::string(VIREO_SOURCE_DIR) +
                            "/tools/ab-bench.sh " + args + " >" + (tmp / "out") + " 2>" + (tmp / "err");
    const int status = std::system(cmd.c_str());
    r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    r.out = read_file(tmp / "out");
    r.err = read_file(tmp / "err");
  };
  RunResult r;
  sh("-r 2 -o " + (tmp / "runs") + " - VIREO_AB_UNUSED=1 -- -m " + kFixture + " --prompt 4 --decode 4", r);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  std::istringstream lines(r.out);
  std::string line;
  int rounds = 0, medians = 0;
  bool in_medians = false;
  while (std::getline(lines, line)) {
    if (line.rfind("round ", 0) == 0) {
      ++rounds;
      EXPECT_NE(line.find("decode "), std::string::npos) << line;
    }
    if (line.rfind("median of 2 round(s)", 0) == 0) in_medians = true;
    else if (in_medians) {
      ++medians;
      EXPECT_TRUE(line.find("decode ") != std::string::npos && line.find('%') != std::string::npos) << line;
    }
  }
  EXPECT_EQ(rounds, 4) << r.out;
  EXPECT_EQ(medians, 2) << r.out;
  sh("-r 1 nonsense", r);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("variant 'nonsense'"), std::string::npos) << r.err;

  // The CUDA bench's lines (no GPU here: a stand-in prints them, its percentages set by the
  // variant's environment): decode contexts and prefill lengths, each variant's median.
  const std::string fake = write_script(
      tmp / "fake-vireo",
      "echo \"decode ctx 0       greedy/device     531.50 tok/s  6.022 GB/token     3201 GB/s  = ${D0:-75.1}% of "
      "copy bandwidth\"\n"
      "echo \"decode ctx 4096    greedy/device     460.00 tok/s  6.076 GB/token     2795 GB/s  =  65.7% of copy "
      "bandwidth\"\n"
      "echo \"prefill 512    fast-fp8   15000.0 tok/s  0.0341 s    310.0 TFLOP/s  =  ${P0:-39.4}% of bf16 GEMM "
      "peak (median of 3)\"\n"
      "echo \"prefill 4096   fast-fp8   20000.0 tok/s  0.2000 s    420.0 TFLOP/s  =  53.9% of bf16 GEMM peak "
      "(median of 3)\"\n");
  const std::string cmd = "VIREO=" + fake + " bash " + std::string(VIREO_SOURCE_DIR) + "/tools/ab-bench.sh -r 3 -o " +
                          (tmp / "fake") + " - D0=80.5,P0=51.3 >" + (tmp / "out") + " 2>" + (tmp / "err");
  const int status = std::system(cmd.c_str());
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << read_file(tmp / "err");
  const std::string out = read_file(tmp / "out");
  EXPECT_NE(out.find("ctx 0 75.1%  ctx 4096 65.7%  prefill 512 39.4%  prefill 4096 53.9%"), std::string::npos) << out;
  EXPECT_NE(out.find("ctx 0 80.5%  ctx 4096 65.7%  prefill 512 51.3%  prefill 4096 53.9%"), std::string::npos) << out;
  EXPECT_NE(out.find("ctx 0 80.5% (80.5-80.5)  ctx 4096 65.7% (65.7-65.7)"), std::string::npos) << out;

  // Another binary with assignments of its own (bin=PATH among them); a second bin= or a missing
  // binary is refused by name.
  const std::string other = write_script(tmp / "other-vireo",
                                         "echo \"decode ctx 0  greedy/device  1.0 tok/s  = ${D0:-70.0}% of copy "
                                         "bandwidth\"\necho \"decode ctx 4096  greedy/device  1.0 tok/s  =  61.2% of "
                                         "copy bandwidth\"\n");
  const std::string oc = "VIREO=" + fake + " bash " + std::string(VIREO_SOURCE_DIR) + "/tools/ab-bench.sh -r 1 -o " +
                         (tmp / "other") + " - bin=" + other + ",D0=77.7 bin=" + other + " >" + (tmp / "out") + " 2>" +
                         (tmp / "err");
  const int os = std::system(oc.c_str());
  ASSERT_TRUE(WIFEXITED(os) && WEXITSTATUS(os) == 0) << read_file(tmp / "err");
  const std::string oo = read_file(tmp / "out");
  const std::string omed = oo.substr(std::min(oo.size(), oo.find("median of")));
  EXPECT_NE(omed.find("ctx 0 75.1%  ctx 4096 65.7%"), std::string::npos) << oo;
  EXPECT_NE(omed.find("ctx 0 77.7%  ctx 4096 61.2%"), std::string::npos) << oo;
  EXPECT_NE(omed.find("ctx 0 70.0%  ctx 4096 61.2%"), std::string::npos) << oo;
  for (const std::string& bad : {"bin=" + other + ",bin=" + other, "bin=" + (tmp / "missing") + ",D0=1"}) {
    const std::string bc = "VIREO=" + fake + " bash " + std::string(VIREO_SOURCE_DIR) + "/tools/ab-bench.sh -r 1 -o " +
                           (tmp / "bad") + " " + bad + " >" + (tmp / "out") + " 2>" + (tmp / "err");
    const int bs = std::system(bc.c_str());
    EXPECT_TRUE(WIFEXITED(bs) && WEXITSTATUS(bs) == 2) << bad;
    EXPECT_NE(read_file(tmp / "err").find("variant '" + bad + "'"), std::string::npos) << read_file(tmp / "err");
  }

  // Rounds that differ: each median is followed by the rounds' lowest and highest (a stand-in
  // whose prefill reads 41.1, 45.6, 42.8 in its three calls); one round prints no range.
  const std::string varying = write_script(
      tmp / "varying-vireo",
      "n=$(cat " + (tmp / "calls") + " 2>/dev/null || echo 0); echo $((n + 1)) >" + (tmp / "calls") +
          "\n"
          "case $n in 0) p=41.1 ;; 1) p=45.6 ;; *) p=42.8 ;; esac\n"
          "echo \"prefill 512    fast-fp8   15000.0 tok/s  0.0341 s    310.0 TFLOP/s  =  $p% of bf16 GEMM peak\"\n");
  for (int rounds : {3, 1}) {
    std::filesystem::remove(tmp / "calls");
    const std::string vc = "VIREO=" + varying + " bash " + std::string(VIREO_SOURCE_DIR) + "/tools/ab-bench.sh -r " +
                           std::to_string(rounds) + " -o " + (tmp / "varying") + " - >" + (tmp / "out") + " 2>" +
                           (tmp / "err");
    const int vs = std::system(vc.c_str());
    ASSERT_TRUE(WIFEXITED(vs) && WEXITSTATUS(vs) == 0) << read_file(tmp / "err");
    const std::string vo = read_file(tmp / "out");
    const std::string medians = vo.substr(std::min(vo.size(), vo.find("median of")));
    if (rounds == 3) EXPECT_NE(medians.find("prefill 512 42.8% (41.1-45.6)"), std::string::npos) << vo;
    else
      EXPECT_TRUE(medians.find("prefill 512 41.1%  ") != std::string::npos &&
                  medians.find("(41.1") == std::string::npos)
          << vo;
  }
  // With the CUDA bench's copy bandwidth line: each variant's median us a greedy step, and its
  // percentage of the call's median copy bandwidth (not of each run's own). Six runs, interleaved:
  // '-' at 500, 400, 500 tok/s, SLOW=1 at 400 each; copies 4000, 3000, 4000, 4000, 5000, 5000 GB/s
  // (median 4000): '-' 2000 us a step (2000-2500), 6.022 GB x 500 / 4000 = 75.3%; SLOW 2500 us, 60.2%.
  const std::string copying = write_script(
      tmp / "copying-vireo",
      "n=$(cat " + (tmp / "ccalls") + " 2>/dev/null || echo 0); echo $((n + 1)) >" + (tmp / "ccalls") +
          "\n"
          "case $n in 0) t=500 c=4000 ;; 1) t=400 c=3000 ;; 2|3) t=400 c=4000 ;; *) t=500 c=5000 ;; esac\n"
          "[ -n \"$SLOW\" ] && t=400\n"
          "echo \"copy bandwidth     $c GB/s (device-to-device, read + write, measured now)\"\n"
          "echo \"decode ctx 0       greedy/device     $t.00 tok/s  6.022 GB/token (weights + cache)     3000 GB/s  =  "
          "75.0% of copy bandwidth\"\n");
  const std::string cc = "VIREO=" + copying + " bash " + std::string(VIREO_SOURCE_DIR) + "/tools/ab-bench.sh -r 3 -o " +
                         (tmp / "copying") + " - SLOW=1 >" + (tmp / "out") + " 2>" + (tmp / "err");
  const int cs = std::system(cc.c_str());
  ASSERT_TRUE(WIFEXITED(cs) && WEXITSTATUS(cs) == 0) << read_file(tmp / "err");
  const std::string co = read_file(tmp / "out");
  const std::string steps = co.substr(std::min(co.size(), co.find("median us a greedy step")));
  EXPECT_NE(steps.find("copy bandwidth (4000 GB/s, every run's median)"), std::string::npos) << co;
  EXPECT_NE(steps.find("ctx 0 2000.0 us (2000.0-2500.0) 75.3%"), std::string::npos) << co;
  EXPECT_NE(steps.find("ctx 0 2500.0 us (2500.0-2500.0) 60.2%"), std::string::npos) << co;
}
