// Chat templates end to end: the real templates from ../shared (DeepSeek-V3, Qwen3, Gemma 3) and the
// GLM-5-style template in tests/data/chat, each over a set of conversations, compared byte for byte
// with transformers' apply_chat_template (goldens from tools/make_template_goldens.py).
#include <gtest/gtest.h>
#include <zlib.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "test_helpers.h"
#include "text/chat_template.h"

using vireo::ChatTemplate;
using vireo::Error;
using ojson = nlohmann::ordered_json;
namespace fs = std::filesystem;

namespace {

using vireo::test::gunzip_file;
using vireo::test::read_file;


std::string shared_tokenizer_dir() { return std::string(VIREO_SHARED_DIR) + "/data/tokenizers"; }

ojson goldens(const std::string& id) {
  return ojson::parse(read_file(std::string(VIREO_SOURCE_DIR) + "/tests/data/chat/goldens_" + id + ".json"));
}

// Renders every golden case; returns the number of mismatches (each reported).
int check_goldens(const ChatTemplate& ct, const ojson& doc) {
  int mismatches = 0;
  for (const auto& c : doc["cases"]) {
    const std::string name = c["name"];
    std::string got;
    bool threw = false;
    std::string err;
    try {
      got = ct.render(c["messages"], c["add_generation_prompt"].get<bool>(), c["extra"]);
    } catch (const Error& e) {
      threw = true;
      err = e.what();
    }
    if (c.contains("expected")) {
      if (threw) {
        ADD_FAILURE() << name << ": unexpected error: " << err;
        ++mismatches;
      } else if (got != c["expected"].get<std::string>()) {
        ADD_FAILURE() << name << ":\n--- expected\n" << c["expected"].get<std::string>() << "\n--- got\n" << got;
        ++mismatches;
      }
    } else if (!threw) {
      ADD_FAILURE() << name << ": expected an error (" << c["error"] << "), got output:\n" << got;
      ++mismatches;
    }
  }
  return mismatches;
}

void check_shared_template(const std::string& id) {
  const std::string gz = shared_tokenizer_dir() + "/" + id + "/tokenizer_config.json.gz";
  if (!fs::exists(gz)) GTEST_SKIP() << "shared tokenizers not available: " << gz << " is missing";
  ojson config = ojson::parse(gunzip_file(gz));
  ChatTemplate ct = ChatTemplate::from_tokenizer_config_json(config, id);
  ojson doc = goldens(id);
  EXPECT_EQ(check_goldens(ct, doc), 0) << id << ": " << doc["cases"].size() << " cases";
}

}  // namespace

TEST(ChatTemplate, DeepSeekV3Goldens) { check_shared_template("deepseek_v3"); }
TEST(ChatTemplate, Qwen3Goldens) { check_shared_template("qwen3"); }
TEST(ChatTemplate, Gemma3Goldens) { check_shared_template("gemma3"); }

TEST(ChatTemplate, Glm5Goldens) {
  ojson doc = goldens("glm5");
  std::map<std::string, std::string> special;
  for (auto it = doc["special_tokens"].begin(); it != doc["special_tokens"].end(); ++it) special[it.key()] = it.value();
  ChatTemplate ct(read_file(std::string(VIREO_SOURCE_DIR) + "/tests/data/chat/glm5_template.jinja"), special, "glm5");
  EXPECT_EQ(check_goldens(ct, doc), 0);
}

TEST(ChatTemplate, FromTokenizerConfigFile) {
  const std::string gz = shared_tokenizer_dir() + "/deepseek_v3/tokenizer_config.json.gz";
  if (!fs::exists(gz)) GTEST_SKIP() << "shared tokenizers not available: " << gz << " is missing";
  fs::path tmp = fs::temp_directory_path() / "vireo_test_chat_template_config.json";
  {
    std::ofstream f(tmp, std::ios::binary);
    f << gunzip_file(gz);
  }
  ChatTemplate ct = ChatTemplate::from_tokenizer_config(tmp.string());
  fs::remove(tmp);
  EXPECT_EQ(ct.bos_token(), "<｜begin▁of▁sentence｜>");  // AddedToken dict form
  EXPECT_EQ(ct.eos_token(), "<｜end▁of▁sentence｜>");
  EXPECT_EQ(ct.render(ojson::parse(R"([{"role":"user","content":"hi"}])"), true),
            "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜>");
}

TEST(ChatTemplate, NamedTemplateList) {
  ojson config = ojson::parse(R"({
    "bos_token": "<s>", "eos_token": {"__type": "AddedToken", "content": "</s>"},
    "chat_template": [
      {"name": "default", "template": "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"},
      {"name": "tool_use", "template": "TOOLS{{ tools | length }}:{{ messages[0].content }}{{ eos_token }}"}
    ]})");
  ChatTemplate ct = ChatTemplate::from_tokenizer_config_json(config, "inline");
  ojson msgs = ojson::parse(R"([{"role":"user","content":"hi"}])");
  EXPECT_EQ(ct.render(msgs, false), "<s>hi");
  EXPECT_EQ(ct.render(msgs, false, {{"tools", ojson::array({{{"name", "f"}}})}}), "TOOLS1:hi</s>");
  EXPECT_TRUE(ct.has_tool_use_template());
}

TEST(ChatTemplate, NormalizesMessagesLikeTransformers) {
  ChatTemplate ct("{% for m in messages %}{{ m | tojson }}{% endfor %}|{{ tools }}|{{ documents }}", {});
  ojson msgs = ojson::parse(R"([{"role":"assistant","content":null,"reasoning":"r"}])");
  EXPECT_EQ(ct.render(msgs, false), R"({"thinking": "r", "role": "assistant", "reasoning": "r", "reasoning_content": "r"}|None|None)");
}

TEST(ChatTemplate, BadConfigsAreErrors) {
  EXPECT_THROW(ChatTemplate::from_tokenizer_config_json(ojson::parse(R"({"eos_token": "x"})"), "c"), Error);
  EXPECT_THROW(ChatTemplate::from_tokenizer_config_json(ojson::parse(R"({"chat_template": 3})"), "c"), Error);
  EXPECT_THROW(ChatTemplate::from_tokenizer_config_json(ojson::parse(R"({"chat_template": "{% if %}"})"), "c"), Error);
  EXPECT_THROW(ChatTemplate::from_tokenizer_config("/nonexistent/tokenizer_config.json"), Error);
  ChatTemplate ct("{{ messages[0].content }}", {});
  EXPECT_THROW(ct.render(ojson::array(), true), Error);
}

// A model directory as transformers >= 4.49 saves it: the template in chat_template.jinja (named
// ones in additional_chat_templates/), the special tokens still in tokenizer_config.json. The file
// wins over a config's own chat_template; without either there is no template.
TEST(ChatTemplate, FromModelDirReadsChatTemplateJinja) {
  vireo::test::TempDir dir("chat_dir");
  const ojson msgs = ojson::parse(R"([{"role":"user","content":"hi"}])");
  EXPECT_FALSE(ChatTemplate::model_dir_has_template(dir.str()));
  EXPECT_THROW(ChatTemplate::from_model_dir(dir.str()), Error);
  vireo::test::write_file(dir / "tokenizer_config.json",
                          R"({"bos_token": "<s>", "chat_template": "CONFIG{{ messages[0].content }}"})");
  EXPECT_TRUE(ChatTemplate::model_dir_has_template(dir.str()));
  EXPECT_EQ(ChatTemplate::from_model_dir(dir.str()).render(msgs, false), "CONFIGhi");
  vireo::test::write_file(dir / "chat_template.jinja", "{{ bos_token }}FILE{{ messages[0].content }}");
  EXPECT_EQ(ChatTemplate::from_model_dir(dir.str()).render(msgs, false), "<s>FILEhi");
  fs::create_directories(dir / "additional_chat_templates");
  vireo::test::write_file(dir / "additional_chat_templates/tool_use.jinja", "TOOLS{{ tools | length }}");
  const ChatTemplate ct = ChatTemplate::from_model_dir(dir.str());
  EXPECT_TRUE(ct.has_tool_use_template());
  EXPECT_EQ(ct.render(msgs, false, {{"tools", ojson::array({{{"name", "f"}}})}}), "TOOLS1");
  vireo::test::write_file(dir / "chat_template.jinja", "{% if %}");
  EXPECT_THROW(ChatTemplate::from_model_dir(dir.str()), Error);
}
